"""Every rule has a failing fixture (only that rule fails or warns) and a passing twin; shipped recipes are clean."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from validate_helpers import RECIPES, invoke, validate_file
from v4launch.validators import RULES
from validator_fixtures import ALSO_FAILS, CASES, unimplemented_refusals


def _statuses(report) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in report.all_results:
        out.setdefault(r.rule_id, set()).add(r.status)
    return out


def test_every_rule_has_cases():
    assert set(CASES) == set(RULES), "add a (failing, passing) mutation for every rule to validator_fixtures.CASES"


def test_base_fixture_is_clean(base_file: Path):
    report = validate_file(base_file)
    assert report.ok and not report.warnings
    statuses = _statuses(report)
    assert not [rid for rid, s in statuses.items() if s & {"fail", "warn"}]


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_failing_fixture_trips_only_its_rule(rule_id: str, base_file: Path):
    bad, _ = CASES[rule_id]
    report = validate_file(base_file, bad)
    if RULES[rule_id].severity == "error":
        assert unimplemented_refusals(report.failed_rule_ids(), rule_id) - ALSO_FAILS.get(rule_id, set()) == {rule_id}
        assert not report.ok
        assert not report.warnings
    else:
        assert not unimplemented_refusals({v.rule_id for v in report.violations}, rule_id)
        assert {w.rule_id for w in report.warnings} == {rule_id}
    found = next(v for v in report.violations + report.warnings if v.rule_id == rule_id)
    assert found.field and found.fix and found.message
    assert found.source != "-"
    assert "internal error" not in found.message


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_passing_twin(rule_id: str, base_file: Path):
    _, good = CASES[rule_id]
    report = validate_file(base_file, good)
    assert not unimplemented_refusals(report.failed_rule_ids(), rule_id) and not report.warnings
    assert "pass" in _statuses(report)[rule_id], "the twin must exercise the rule, not skip it"


def test_violation_names_where_the_value_was_set(base_file: Path):
    report = validate_file(base_file, ["parallel.tp=2"])
    (v,) = report.violations
    assert (v.rule_id, v.field, v.value, v.source) == ("V4-TP-ONE", "parallel.tp", 2, "override parallel.tp=2")
    report = validate_file(base_file, ["curriculum.stages.3.seq_len=200"])
    (v,) = report.violations
    assert v.stage == "sparse_8k" and v.field == "curriculum.stages.3.seq_len"
    assert v.source.endswith(":") is False and "override" in v.source


def test_stage_rules_run_per_stage(base_file: Path):
    report = validate_file(base_file)
    assert [s.name for s in report.stages] == ["dense_4k", "warmup_4k", "sparse_4k", "sparse_8k"]
    cp_rule = {s.name: next(r.status for r in s.results if r.rule_id == "V4-CP-BOUNDARY") for s in report.stages}
    assert cp_rule == {"dense_4k": "n/a", "warmup_4k": "n/a", "sparse_4k": "n/a", "sparse_8k": "pass"}


def test_sm90_dense_loss_proposes_what_the_job_runs(base_file: Path):
    """The warm-up stage's KL target is tied to its phase, so the fix is the stage's kernels (issue 19): on SM90
    the cudnn dense-loss path is refused and the Triton kernels proposed, which train the dense KL (issue 40)."""
    bad = ["curriculum.stages.1.kernel_backend=cudnn"]
    (v,) = [v for v in validate_file(base_file, bad).violations if v.rule_id == "V4-SM90-DENSE-LOSS"]
    assert v.fix == "set curriculum.stages.1.kernel_backend=triton" and "indexer_loss" not in v.fix
    assert validate_file(base_file, [*bad, "curriculum.stages.1.kernel_backend=triton"]).ok
    results = {s.name: r for s in validate_file(base_file).stages for r in s.results
               if r.rule_id == "V4-SM90-DENSE-LOSS"}
    assert results["warmup_4k"].status == "pass"  # triton trains the dense target on SM90


def test_balance_violation_proposes_a_layout(base_file: Path):
    v = validate_file(base_file, ["parallel.pp_layout=Et|t*7mL"]).violations[0]
    assert "pp_layout=E" in v.fix


SHIPPED = sorted(p.name for p in RECIPES.glob("*.yaml"))


def test_recipes_shipped():
    assert {"flash.yaml", "flash_4n.yaml", "flash_8n.yaml", "pro.yaml", "pro_64n.yaml", "tiny_cpu.yaml"} <= set(SHIPPED)


OVER_BUDGET = {"pro_16n.yaml"}
"""Pro on 16 nodes, shipped to show the refusal: no layout of 128 H200 holds the curriculum in this job, even with
precision-aware storage and host offload (docs/memory-plan.md), so every stage fails V4-MEMORY and nothing else
fails. (flash_4n.yaml, refused the same way until precision-aware storage, now fits: test_flash_4n_shape.)"""

FULL_RECOMPUTE = {"flash.yaml", "flash_4n.yaml", "flash_8n.yaml", "pro.yaml", "pro_16n.yaml", "pro_64n.yaml"}
"""Paper-scale recipes: whole-layer recompute at cp > 1 replays the CP collectives, which validate reports
(V4-RECOMPUTE-REPLAY, a warning) and nothing else."""


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_validates_clean(name: str, in_tmp: Path):
    """Every shipped recipe validates clean but the over-budget one, and every fix validate prints for a failing
    one, pasted as printed (the `v4launch validate …` line), validates clean."""
    report = validate_file(RECIPES / name)
    if report.violations:
        _printed_fixes_validate(RECIPES / name)
    problems = [f"{v.rule_id} [{v.stage}] {v.field}={v.value!r}: {v.message}" for v in report.violations + report.warnings]
    if name in FULL_RECOMPUTE:
        assert {w.rule_id for w in report.warnings} == {"V4-RECOMPUTE-REPLAY"}, problems
        problems = [f"{v.rule_id} [{v.stage}] {v.field}={v.value!r}: {v.message}" for v in report.violations]
    if name in OVER_BUDGET:
        assert report.failed_rule_ids() == {"V4-MEMORY"}, problems
        assert {v.stage for v in report.violations} == {s.name for s in report.stages}
        return
    assert not problems, f"{name} should validate clean: {problems}"


def _printed_fixes_validate(path: Path) -> None:
    """Run ``v4launch validate PATH``, then each distinct ``fix: run `…``` command it prints: each exits 0."""
    code, out, _, exc = invoke(["validate", str(path)])
    assert exc is None and code == 1
    commands = list(dict.fromkeys(re.findall(r"run `(v4launch validate [^`]+)`", out)))
    assert commands, out[-2000:]
    for command in commands:
        code, again, _, exc = invoke(shlex.split(command)[1:])
        assert exc is None and code == 0, (command, [ln for ln in again.splitlines() if ln.startswith("fail")])


def test_flash_4n_shape():
    """PP1 with EP32 x FSDP over all 32 GPUs, bf16 storage with remainders and bf16 moments, whole-layer recompute
    with the layer inputs in host memory, CP 4 at 64K up to 32 at 1M (32K rows per rank); and every stage fits."""
    from v4launch.recipe_loading import load_recipe

    r = load_recipe(RECIPES / "flash_4n.yaml").recipe
    assert (r.cluster.nodes, r.cluster.gpus_per_node, r.cluster.gpu) == (4, 8, "H200")
    assert (r.parallel.pp, r.parallel.pp_layout, r.parallel.ep) == (1, None, 32)
    pr = r.precision
    assert (pr.params_dtype, pr.store_param_remainders, pr.exp_avg_dtype, pr.exp_avg_sq_dtype) == ("bf16", True, "bf16", "bf16")
    assert r.parallel.cpu_offloading and r.parallel.recompute_granularity == "full"
    assert [s.seq_len for s in r.curriculum.stages][0] == 65536 and r.curriculum.stages[-1].seq_len == 1048576
    assert [r.stage_cp(s) for s in r.curriculum.stages] == [4, 4, 4, 8, 16, 32]
    report = validate_file(RECIPES / "flash_4n.yaml")
    assert report.ok and all(s.derived["memory"]["fits"] for s in report.stages)
