"""Validator and job agree (issue 19): a fix that a rule proposes fixes the recipe, and the job runs it.

Before issue 19, V4-SM90-DENSE-LOSS proposed ``curriculum.stages.1.indexer_loss=sparse`` for a
warm-up stage; `v4launch run` refuses that ("the bundled model ties the KL target to the phase").
Here every failing fixture's violations are fixed by applying their proposed ``key=value`` edits
(the first alternative of the fix), then the recipe must validate clean and the job's own
curriculum planner (``v4launch.training.plan.plan_curriculum``) must accept it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from validate_helpers import validate_file
from v4launch.errors import ContractViolation
from v4launch.recipe_loading import load_recipe
from v4launch.training.plan import plan_curriculum
from v4launch.validators import RULES
from validator_fixtures import CASES

SETTING = re.compile(r"'([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)=([^']*)'|\b([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)=([^\s,;()']+)")
REMOVAL = re.compile(r"\bremove ([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)")


def proposed_edits(fix: str) -> list[str]:
    """The ``key=value`` overrides of the first alternative of ``fix`` ("remove k" means k=null)."""
    first = re.split(r",? or |; ", fix)[0]
    pairs = [(qk or k, qv if qk else v) for qk, qv, k, v in SETTING.findall(first)]  # 'k=v' as a shell quotes it
    return [f"{k}={v}" for k, v in pairs] + [f"{k}=null" for k in REMOVAL.findall(first)]


def _job_accepts(path: Path, overrides: list[str]) -> None:
    """The job's planner accepts the recipe as written (pp, ep, distributed optimizer and cp included)."""
    recipe = load_recipe(path, overrides).recipe
    plan_curriculum(recipe, recipe.cluster.world_size)


MACHINE_READABLE = sorted(rid for rid, (bad, _) in CASES.items() if RULES[rid].severity == "error")


@pytest.mark.parametrize("rule_id", MACHINE_READABLE)
def test_proposed_fix_is_valid_and_runnable(rule_id: str, base_file: Path):
    bad, _ = CASES[rule_id]
    report = validate_file(base_file, bad)
    edits = [e for v in report.violations for e in proposed_edits(v.fix)]
    if not edits:
        pytest.skip(f"{rule_id}'s fix is prose, not key=value: {report.violations[0].fix}")
    fixed = validate_file(base_file, [*bad, *edits])
    assert fixed.ok, f"{rule_id}: {edits} leave {[(v.rule_id, v.message) for v in fixed.violations]}"
    _job_accepts(base_file, [*bad, *edits])


def test_the_fixes_that_matter_here_are_machine_readable(base_file: Path):
    for rule_id in ("V4-SM90-DENSE-LOSS", "V4-PHASE-INDEXER-TARGET", "V4-PHASE-DENSE-NO-INDEXER", "V4-PP-VPP",
                    "V4-PP-MICROBATCHES", "V4-TP-ONE", "V4-CP-THD", "V4-KERNEL-AVAILABLE", "V4-PP-LAYOUT"):
        report = validate_file(base_file, CASES[rule_id][0])
        assert all(proposed_edits(v.fix) for v in report.violations), (rule_id, [v.fix for v in report.violations])


def test_warmup_sparse_target_is_what_the_job_refuses(base_file: Path):
    """The validator refuses exactly what the planner refuses, so `validate` clean means `run` starts."""
    bad = ["curriculum.stages.1.indexer_loss=sparse"]
    assert validate_file(base_file, bad).failed_rule_ids() == {"V4-PHASE-INDEXER-TARGET"}
    with pytest.raises(ContractViolation, match="ties the KL target to the phase"):
        _job_accepts(base_file, bad)


@pytest.mark.parametrize("fix, edits", [
    ("set curriculum.stages.1.kernel_backend=reference", ["curriculum.stages.1.kernel_backend=reference"]),
    ("remove curriculum.stages.1.indexer_loss (set it to null)", ["curriculum.stages.1.indexer_loss=null"]),
    ("set parallel.vpp=1 and parallel.pp_layout=null (one stage), or raise parallel.pp above 1",
     ["parallel.vpp=1", "parallel.pp_layout=null"]),
    ("set parallel.pp_layout=Et*3|t*2|t*2|tmL (max/mean 1.175)", ["parallel.pp_layout=Et*3|t*2|t*2|tmL"]),
    ("set 'parallel.pp_layout=Et*4|(tttt|)*14tmL' parallel.pp=4 (max/mean 1.1)",
     ["parallel.pp_layout=Et*4|(tttt|)*14tmL", "parallel.pp=4"]),
    ("make the global batch a multiple of micro_batch·dp", []),
])
def test_proposed_edits_parser(fix: str, edits: list[str]):
    assert proposed_edits(fix) == edits


def test_mtp_layers_outside_the_loss_stage_get_them_moved_before_l(base_file: Path):
    """V4-PP-MTP-WITH-LOSS proposes the same layout with every 'm' moved right before the last stage's L, which
    passes the rule; where moving them would empty a stage, the fix stays prose (the boundaries must move)."""
    bad = ["parallel.pp=4", "model.vocab_size=9216", "parallel.pp_layout=Et*2|t*2|t*2m|t*2L"]
    found = [v for v in validate_file(base_file, bad).violations if v.rule_id == "V4-PP-MTP-WITH-LOSS"]
    assert found and proposed_edits(found[0].fix) == ["parallel.pp_layout=Et*2|t*2|t*2|t*2mL"]
    fixed = validate_file(base_file, [*bad, *proposed_edits(found[0].fix)])
    assert "V4-PP-MTP-WITH-LOSS" not in fixed.failed_rule_ids()
    emptied = validate_file(base_file, CASES["V4-PP-MTP-WITH-LOSS"][0]).violations
    assert not proposed_edits(next(v.fix for v in emptied if v.rule_id == "V4-PP-MTP-WITH-LOSS"))
