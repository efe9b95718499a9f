"""Megatron / Primus names users carry over point to our field or say there is none: as recipe keys and as
command-line flags (`v4launch validate RECIPE --tensor-model-parallel-size 1`, which click used to refuse as
"No such option")."""

from __future__ import annotations

from pathlib import Path

import pytest

from validate_helpers import RECIPES, invoke
from v4launch.validators.peer_names import NO_EQUIVALENT, PEER_NAMES
from v4launch.validators.schema import Recipe

FLASH_4N = str(RECIPES / "flash_4n.yaml")


def _fields(model, prefix: str = "") -> set[str]:
    import typing

    out = set()
    for name, f in model.model_fields.items():
        subs = [a for a in (f.annotation, *typing.get_args(f.annotation)) if hasattr(a, "model_fields")]
        out |= _fields(subs[0], f"{prefix}{name}.") if subs and name != "stages" else {prefix + name}
    return out


def test_every_peer_name_points_at_a_field_that_exists_and_no_field_is_called_none():
    from v4launch.validators.schema.curriculum import Stage

    ours = _fields(Recipe) | {f"curriculum.stages.N.{name}" for name in Stage.model_fields}
    ours |= {path.rsplit(".", i)[0] for path in ours for i in range(1, path.count(".") + 1)}  # sections too
    for peer, (_, target) in PEER_NAMES.items():
        for path in (p.strip("(),") for p in target.split() if "." in p and p[0].isalpha()):
            assert path in ours or not path.split(".")[0] in {"model", "parallel", "optimizer", "precision", "data",
                                                            "run", "curriculum", "logging", "checkpointing"}, (peer, path)
    leaves = {p.rsplit(".", 1)[-1] for p in ours}
    assert not set(NO_EQUIVALENT) & (leaves | set(PEER_NAMES))


@pytest.mark.parametrize("flag, needle, hint", [
    (["--tensor-model-parallel-size", "1"], "--tensor-model-parallel-size is Megatron's flag; here it is the recipe "
     "field parallel.tp", "v4launch validate RECIPE parallel.tp=1"),
    (["--pipeline-model-parallel-size=2"], "here it is the recipe field parallel.pp", "parallel.pp=2"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "here it is the recipe field parallel.vpp", "pp·vpp stages"),
    (["--decoder-first-pipeline-num-layers", "10"], "here it is the recipe field parallel.pp_layout", "first stage"),
    (["--moe-router-force-load-balancing"], "there is no such setting here: a benchmarking switch", "drop it"),
    (["--jsn"], "no such option: --jsn", "`v4launch validate --help` lists the options"),
])
def test_a_peer_flag_given_to_validate_names_our_field(flag: list[str], needle: str, hint: str, in_tmp: Path):
    code, out, err, exc = invoke(["validate", FLASH_4N, *flag])
    assert exc is None and code == 2 and not out
    assert needle in err and hint in err and "No such option" not in err


def test_a_peer_flag_before_the_recipe_or_given_to_submit_is_named_too(in_tmp: Path):
    code, _, err, _ = invoke(["validate", "--context-parallel-size", "8", FLASH_4N])
    assert code == 2 and "here it is the recipe field parallel.cp" in err
    code, _, err, _ = invoke(["submit", FLASH_4N, "--expert-model-parallel-size", "8", "--dry-run"])
    assert code == 2 and "parallel.ep" in err and "v4launch submit RECIPE parallel.ep=8" in err


@pytest.mark.parametrize("override, needle", [
    ("parallel.decoder_first_pipeline_num_layers=10", "decoder_first_pipeline_num_layers is Megatron's name; here it "
     "is parallel.pp_layout"),
    ("parallel.decoder_last_pipeline_num_layers=9", "here it is parallel.pp_layout"),
    ("parallel.num_layers_per_virtual_pipeline_stage=2", "here it is parallel.vpp"),
    ("model.moe.moe_router_force_load_balancing=true", "moe_router_force_load_balancing is Megatron's name; there is "
     "no such setting here"),
    ("parallel.sequence_parallel=true", "there is no such setting here: tensor parallelism is 1"),
])
def test_a_peer_key_in_the_recipe_names_our_field_or_says_there_is_none(override: str, needle: str, in_tmp: Path):
    code, _, err, exc = invoke(["validate", FLASH_4N, override])
    assert exc is None and code == 2 and needle in err
