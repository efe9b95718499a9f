"""What ``validate`` passes of the model section, the job's model builds, and what the model refuses, ``validate``
refuses first: the schema plus the model-shape rules (V4-MODEL-BUILD, V4-OGROUPS, V4-RATIOS-LENGTH) against
``ModelArgs`` (model/args.py), which the job builds from the recipe (training/model_adapter.py).

Found by a fresh-clone check: ``validate`` passed tiny_cpu with n_heads=3 and o_groups=2 and the job then refused it
on every rank; rope_head_dim 7, two shared experts, more hash layers than layers and a 24-channel indexer with the
Hadamard rotation passed ``validate`` too."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from v4launch.errors import ContractViolation, V4LaunchError
from v4launch.recipe_loading import load_recipe
from v4launch.training.model_adapter import model_args_from_recipe
from v4launch.validators import validate_recipe

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
SHAPE_RULES = {"V4-MODEL-BUILD", "V4-OGROUPS", "V4-RATIOS-LENGTH"}

SHAPE = st.fixed_dictionaries({
    "model.n_heads": st.integers(1, 6),
    "model.head_dim": st.sampled_from([8, 12, 16, 24, 32]),
    "model.rope_head_dim": st.integers(0, 34),
    "model.indexer.head_dim": st.sampled_from([8, 12, 16, 24, 32]),
    "model.indexer.hadamard": st.booleans(),
    "model.o_groups": st.integers(1, 6),
    "model.moe.n_shared_experts": st.integers(0, 3),
    "model.moe.n_hash_layers": st.integers(0, 6),
})


def _verdicts(overrides: list[str]) -> tuple[bool, bool, str]:
    """(validate passes the model section, ModelArgs builds, what said no)."""
    try:
        report = validate_recipe(load_recipe(TINY, overrides))
        failed = SHAPE_RULES & set(report.failed_rule_ids())
        validated, said = not failed, ", ".join(sorted(failed))
    except V4LaunchError as exc:  # a schema error names the field
        validated, said = False, exc.message
    try:
        model_args_from_recipe(load_recipe(TINY, overrides).recipe)
        builds = True
    except ContractViolation as exc:
        builds, said = False, said + " | model: " + exc.message
    except V4LaunchError:  # the schema refuses it before any model is built
        builds = False
    return validated, builds, said


@settings(max_examples=60, deadline=None)
@given(shape=SHAPE)
def test_validate_passes_exactly_the_model_sections_the_model_builds(shape):
    overrides = [f"{key}={str(value).lower()}" for key, value in shape.items()]
    validated, builds, said = _verdicts(overrides)
    assert validated == builds, (overrides, said)


def test_each_model_build_refusal_is_named_before_the_job():
    """One example of each refusal of V4-MODEL-BUILD, each with the field it names; and the fresh-clone case."""
    cases = {
        "model.rope_head_dim=7": "model.rope_head_dim",
        "model.rope_head_dim=40": "model.rope_head_dim",
        "model.moe.n_shared_experts=2": "model.moe.n_shared_experts",
        "model.moe.n_hash_layers=5": "model.moe.n_hash_layers",
        "model.indexer.head_dim=24": "model.indexer.head_dim",
    }
    for override, field in cases.items():
        report = validate_recipe(load_recipe(TINY, [override]))
        found = [v for v in report.violations if v.rule_id == "V4-MODEL-BUILD"]
        assert found and found[0].field == field, (override, report.failed_rule_ids())
        validated, builds, _ = _verdicts([override])
        assert not validated and not builds, override
    validated, builds, said = _verdicts(["model.n_heads=3", "model.indexer.n_heads=3"])
    assert validated and builds, said
