"""`validate` refuses exactly the recompute settings the job's seam refuses (V4-RECOMPUTE vs recompute.py), and
warns (V4-RECOMPUTE-REPLAY) exactly where the job replays collectives."""

from __future__ import annotations

import itertools

import pytest

NAMES = ["layernorm", "mla_up_proj", "moe_act", "shared_experts", "moe", "core_attn", "mlp"]


@pytest.mark.parametrize("shared", [1, 0])
def test_validator_and_job_agree_on_every_recompute_setting(write_recipe, shared):
    from v4launch.model.parallel.recompute import modules_from_recipe
    from v4launch.training.recipe_io import load_recipe
    from v4launch.validators.recompute_policy import replayed_collectives
    from v4launch.validators.rules.attention import recompute_problem
    from v4launch.validators.rules.base import Context, RULES

    base = load_recipe(write_recipe(), [f"model.moe.n_shared_experts={shared}"]).recipe
    sets = [[]] + [[n] for n in NAMES] + [list(p) for p in itertools.combinations(NAMES[:5], 2)]
    checked = 0
    for granularity, mods, cp, ep in itertools.product(("none", "selective", "full"), sets, (1, 2), (1, 2)):
        par = base.parallel.model_copy(update={"recompute_granularity": granularity, "recompute_modules": mods,
                                               "cp": cp, "ep": ep})
        recipe = base.model_copy(update={"parallel": par})
        problem = recompute_problem(recipe)
        try:
            names = modules_from_recipe(granularity, mods)
            if "shared_experts" in names and not shared:
                raise ValueError("no shared experts")  # apply_recompute's refusal (it sees the model)
            job_ok = True
        except ValueError:
            job_ok, names = False, []
        assert (problem is None) == job_ok, (granularity, mods, cp, ep, problem)
        replay = RULES["V4-RECOMPUTE-REPLAY"].check(Context(recipe))
        replays = replayed_collectives(names, max_cp=cp, ep=ep)
        assert (type(replay).__name__ == "Finding") == bool(job_ok and replays), (granularity, mods, cp, ep, replay)
        if job_ok and granularity == "full" and cp > 1:
            assert "boundary exchange" in replay.message
        checked += 1
    assert checked == 3 * len(sets) * 4
