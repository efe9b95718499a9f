"""Every printed fix is a command with values, and pasting it fixes its rule without breaking another (issue 41).

For each failing fixture (``validator_fixtures.CASES``) every violation's and warning's fix is turned into the
``v4launch validate`` line the report prints (``fix_command.pasteable``); each alternative is applied and the
recipe validated again: the rule passes, and no rule fails that did not fail before (fixes that contradict each
other, e.g. a 4-stage layout from V4-PP-LAYOUT where V4-PP-VPP asks for vpp=1, fail here).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from validate_helpers import RECIPES, invoke, validate_file
from v4launch.cli.fix_command import _edits, _split_tail, pasteable
from v4launch.recipe_loading import load_recipe
from v4launch.validators import RULES
from v4launch.validators.memory_fixes import with_edits
from v4launch.validators.rules.contract import contract_beyond, contract_failures
from validator_fixtures import CASES

PROSE_FIXES = {
    "V4-CP-BOUNDARY": "a stage's cp against its seq_len and the boundary width: several levers, none always right",
    "V4-CP-SM": "the GPU is the fix (another cluster)",
    "V4-HOST-MEMORY": "the nodes' RAM is a fact to look up, not a value to propose",
    "V4-MODEL-BUILD": "a model shape: changing it changes the model",
    "V4-OGROUPS": "a model shape: changing it changes the model",
    "V4-PHASE-ORDER": "reordering stages is an edit of the curriculum list",
    "V4-PHASE-SKIP-WARMUP": "inserting a stage is an edit of the curriculum list",
    "V4-PP-LAYOUT-SYNTAX": "the layout does not parse: the grammar is the help",
    "V4-PP-MTP-WITH-LOSS": "prints the moved layout when one can be made (its own fix), else the rule",
    "V4-RATIOS-LENGTH": "a model shape: one entry per layer",
    "V4-RECOMPUTE": "a choice of modules to recompute",
    "V4-RECOMPUTE-REPLAY": "a warning whose remedy is to measure",
    "V4-RELEASED-INIT": "a checkpoint import command to run first",
    "V4-TOPK-VISIBLE": "a warning: the model's top-k or the phase's seq_len",
    "V4-WANDB-INSTALLED": "a package to install",
}
"""Rules whose fix may stay prose, and why; every other rule's fix is a command with values."""


def _findings(base_file: Path, bad: list[str]):
    report = validate_file(base_file, bad)
    return report, [*report.violations, *report.warnings]


def _alternatives(fix: str) -> list[list[str]]:
    """The edits of each ``, or`` alternative that ``pasteable`` turns into a command ([] when prose)."""
    if pasteable(fix, "R", []) == fix:
        return []
    return [_edits(_split_tail(clause)[0]) for clause in fix[4:].split(", or ")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_fix_is_a_command_with_values(case: str, base_file: Path):
    _, found = _findings(base_file, CASES[case][0])
    prose = {(v.rule_id, v.fix) for v in found if not _alternatives(v.fix) and v.rule_id not in PROSE_FIXES}
    assert not prose, f"fixes that name no value to paste: {sorted(prose)}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_printed_fix_pasted_fixes_its_rule_and_breaks_no_other(case: str, base_file: Path):
    bad = CASES[case][0]
    report, found = _findings(base_file, bad)
    before = report.failed_rule_ids()
    for v in found:
        for edits in _alternatives(v.fix):
            after = validate_file(base_file, [*bad, *edits])
            new = {x.rule_id for x in after.violations} - before
            assert not new, f"{v.rule_id}'s fix {edits} makes {sorted(new)} fail"
            again = {x.rule_id for x in [*after.violations, *after.warnings] if x.stage == v.stage}
            assert v.rule_id not in again, f"{v.rule_id}'s fix {edits} leaves it failing in stage {v.stage}"


def test_pp_1_with_vpp_4_gets_one_fix_from_both_pipeline_rules(base_file: Path):
    """V4-PP-LAYOUT proposed a 4-stage layout where V4-PP-VPP asks for vpp=1 and no layout."""
    bad = ["parallel.pp=1", "parallel.vpp=4"]
    report = validate_file(base_file, bad)
    fixes = {v.rule_id: v.fix for v in report.violations}
    assert set(fixes) >= {"V4-PP-LAYOUT", "V4-PP-VPP"} and fixes["V4-PP-LAYOUT"] == fixes["V4-PP-VPP"]
    assert fixes["V4-PP-VPP"].startswith("set parallel.vpp=1 parallel.pp_layout=null ")
    assert validate_file(base_file, [*bad, "parallel.vpp=1", "parallel.pp_layout=null"]).ok


@pytest.mark.parametrize("layout", ["Et*8mL", "Et*8L", "Et*4|t*4mL"])
def test_a_layout_at_pp_vpp_1_is_refused_with_one_fix(layout: str, base_file: Path):
    """A one-stage layout at pp·vpp = 1 was accepted and never read by the job; a broken one got V4-PP-MTP-WITH-LOSS's
    layout fix, which V4-PP-LAYOUT then refused."""
    bad = ["parallel.pp=1", f"parallel.pp_layout={layout}"]
    report = validate_file(base_file, bad)
    (v,) = report.violations
    assert (v.rule_id, v.field, v.value) == ("V4-PP-LAYOUT", "parallel.pp_layout", layout)
    assert "pp·vpp = 1" in v.message and v.fix.startswith("set parallel.pp_layout=null ")
    assert _alternatives(v.fix) == [["parallel.pp_layout=null"]]
    assert validate_file(base_file, [*bad, "parallel.pp_layout=null"]).ok


def test_kernel_available_offers_triton_for_a_warmup_stage_on_sm90(base_file: Path):
    """V4-KERNEL-AVAILABLE's triton alternative needs no reference warm-up stage any more: V4-SM90-DENSE-LOSS
    refuses only the cudnn dense-loss path (the Triton dense KL is held to float64 at Flash width). Each offered
    alternative validates; off SM90 only reference is offered."""
    bad = ["attention.kernel_backend=cudnn"]  # the warm-up stage inherits it
    report = validate_file(base_file, bad)
    assert {v.rule_id for v in report.violations} == {"V4-KERNEL-AVAILABLE", "V4-SM90-DENSE-LOSS"}
    (fix,) = {v.fix for v in report.violations if v.rule_id == "V4-KERNEL-AVAILABLE"}
    alternatives = _alternatives(fix)
    assert ["attention.kernel_backend=triton"] in alternatives
    for edits in alternatives:
        assert validate_file(base_file, [*bad, *edits]).ok, edits
    off_sm90 = validate_file(base_file, [*bad, "cluster.gpu=B200"])
    assert all(alt[0].endswith("=reference") and len(alt) == 1 for v in off_sm90.violations
               if v.rule_id == "V4-KERNEL-AVAILABLE" for alt in _alternatives(v.fix))


@pytest.mark.parametrize("bad", [["parallel.global_batch_size=6"], ["cluster.gpus_per_node=7"],
                                 ["parallel.global_batch_size=4"]])
def test_the_fix_line_printed_by_validate_pasted_as_printed_exits_0(bad: list[str], base_file: Path, in_tmp: Path):
    """V4-BATCH's fix named no number; V4-WORLD-SIZE's none either; the printed line now runs clean."""
    code, out, _, exc = invoke(["validate", str(base_file), *bad])
    assert exc is None and code == 1
    line = next(x for x in out.splitlines() if "fix: run `v4launch validate " in x)
    command = line.split("`")[1]
    words = shlex.split(command)
    assert words[:3] == ["v4launch", "validate", str(base_file)]
    code, out, err, exc = invoke(words[1:])
    assert exc is None and code == 0, (command, out[-2000:])


def test_every_rule_with_a_prose_fix_is_listed_and_exists():
    assert set(PROSE_FIXES) <= set(RULES)


FLASH_8N_B200 = ["cluster.gpu=B200"]
"""flash_8n on B200 (180 GiB): dense_64k needs 202.5 GiB, and `curriculum.stages.0.cp=8` fits at 178 GiB."""


@pytest.mark.parametrize("unrelated", [["curriculum.stages.1.kernel_backend=cudnn"],
                                       ["curriculum.stages.0.kernel_backend=cudnn"]])
def test_an_unrelated_failing_rule_disqualifies_no_memory_fix(unrelated: list[str]):
    """A cudnn stage (V4-KERNEL-AVAILABLE) made every candidate fail the contract: 'nothing fits' instead of cp=8."""
    recipe = RECIPES / "flash_8n.yaml"
    alone = {v.rule_id: v.fix for v in validate_file(recipe, FLASH_8N_B200).violations}
    report = validate_file(recipe, [*FLASH_8N_B200, *unrelated])
    fixes = {v.rule_id: v.fix for v in report.violations}
    assert set(fixes) == {"V4-MEMORY", "V4-KERNEL-AVAILABLE"}
    assert fixes["V4-MEMORY"] == alone["V4-MEMORY"]  # the same fix as without the cudnn stage
    first = _alternatives(fixes["V4-MEMORY"])[0]
    assert first == ["curriculum.stages.0.cp=8"]
    after = validate_file(recipe, [*FLASH_8N_B200, *unrelated, *first])
    assert {v.rule_id for v in after.violations} == {"V4-KERNEL-AVAILABLE"}  # left to its own fix


def test_a_candidate_that_changes_a_standing_failure_still_counts(base_file: Path):
    """Failures the recipe already has are ignored only while the candidate leaves them exactly as they were."""
    recipe = load_recipe(base_file, ["parallel.global_batch_size=6"]).recipe  # V4-BATCH: 6 over dp 4
    assert "V4-BATCH" in contract_failures(recipe)
    contract = contract_beyond(recipe)
    assert contract(recipe) == [] and contract_beyond(recipe) is contract
    assert "V4-BATCH" in contract(with_edits(recipe, {"cluster.nodes": 2}))  # dp 8: another V4-BATCH finding


@pytest.mark.parametrize("recipe, bad", [("flash_4n.yaml", ["parallel.ep=3"]), ("fixture", ["parallel.ep=3"]),
                                         ("fixture", ["parallel.ep=16"])])
def test_ep_experts_and_ep_fold_print_one_memory_checked_fix(recipe: str, bad: list[str], base_file: Path):
    """V4-EP-EXPERTS proposed ep=2 unchecked where V4-EP-FOLD proposed the memory rule's whole fix (flash_4n)."""
    path = base_file if recipe == "fixture" else RECIPES / recipe
    report = validate_file(path, bad)
    fixes = {v.fix for v in report.violations if v.rule_id in ("V4-EP-EXPERTS", "V4-EP-FOLD")}
    assert len(fixes) == 1, fixes
    (edits,) = _alternatives(fixes.pop())
    assert validate_file(path, [*bad, *edits]).ok, edits


def test_an_ep_that_splits_nothing_evenly_is_fixed_by_an_ep_alone_where_one_fits():
    """ep=7 on flash_4n: 4, the largest ep below that divides the experts and dp·cp, does not fit; the fix was the
    whole-recipe search's ep=32 plus four stages' cp. The smallest larger ep that fits alone (32) is the fix now,
    and pasted it passes."""
    report = validate_file(RECIPES / "flash_4n.yaml", ["parallel.ep=7"])
    fixes = {v.fix for v in report.violations if v.rule_id in ("V4-EP-FOLD", "V4-EP-EXPERTS")}
    assert len(fixes) == 1
    (fix,) = fixes
    assert _alternatives(fix) == [["parallel.ep=32"]] and "4, the largest below, does not fit" in fix
    assert validate_file(RECIPES / "flash_4n.yaml", ["parallel.ep=7", "parallel.ep=32"]).ok


def test_a_memory_fix_names_the_failures_it_leaves_to_their_own_fixes():
    """flash_4n on cudnn: the memory fix is searched around the recipe's own failures (V4-KERNEL-AVAILABLE,
    V4-SM90-DENSE-LOSS) and said "no other rule fails"; pasted, those still failed. It now names them, and they
    are exactly what the pasted line fails; without a standing failure it still says "no other rule fails"."""
    bad = ["attention.kernel_backend=cudnn"]
    report = validate_file(RECIPES / "flash_4n.yaml", bad)
    (fix,) = {v.fix for v in report.violations if v.rule_id == "V4-MEMORY"}
    assert "no other rule fails" not in fix and "still fail: their own fixes" in fix
    edits = _alternatives(fix)[0]
    after = validate_file(RECIPES / "flash_4n.yaml", [*bad, *edits])
    left = sorted({v.rule_id for v in after.violations})
    assert left == ["V4-KERNEL-AVAILABLE", "V4-SM90-DENSE-LOSS"] and all(rule in fix for rule in left)
    clean = validate_file(RECIPES / "flash_8n.yaml", ["cluster.nodes=4"])
    assert all(v.fix.endswith("and no other rule fails)") for v in clean.violations if v.rule_id == "V4-EP-FOLD")
