"""Pipeline parallelism in the training job: gloo processes, ranks laid out [pp][dp][cp].

* A pp = 2 run (layout ``Et|ttmL``: the embedding and the hash layer on pipeline rank 0; two layers,
  MTP and the loss on rank 1) gives the losses, gradient norms and held-out losses of the pp = 1 run
  on the same data, through the dense -> warm-up (indexers built on the stage that owns each CSA layer)
  -> sparse phase changes. Compared in float64 (the workers build the model in float64) to 1e-10.
* Two virtual stages per rank (pp 2 x vpp 2, interleaved 1F1B) likewise.
* A pp = 2 run stopped mid-way resumes bitwise; its checkpoint also resumes at pp = 1 (dp 2) through the
  reshard verdict (the manifest records pp and the layout; DCP loads the FQN-keyed shards).
"""

from __future__ import annotations

import json

import pytest
from test_train_cp import _events, _run_float64
from train_helpers import losses, train_records

from v4launch.launchers import LocalLauncher

PP2 = {"cluster": {"gpus_per_node": 2}, "parallel": {"pp": 2, "pp_layout": "Et|ttmL"}}
VPP2 = {"cluster": {"gpus_per_node": 2}, "parallel": {"pp": 2, "vpp": 2, "pp_layout": "Et|t|t|mL"},
        "model": {"n_layers": 3}}


def _evals(run) -> list[float]:
    return [json.loads(x)["lm_loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "eval"]


def _same_numbers(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for s in sorted(a):
        assert set(b[s]["aux"]) == set(a[s]["aux"]), s
        assert b[s]["tokens"] == a[s]["tokens"]
        pairs = [(a[s]["lm_loss"], b[s]["lm_loss"]), (a[s]["grad_norm"], b[s]["grad_norm"]),
                 *((a[s]["aux"][k], b[s]["aux"][k]) for k in a[s]["aux"])]
        assert max(abs(x - y) / max(abs(x), 1e-30) for x, y in pairs) < 1e-10, s


@pytest.mark.slow
@pytest.mark.parametrize("over", [PP2, VPP2], ids=["pp2", "pp2-vpp2"])
def test_pp2_gives_the_pp1_losses_in_float64(new_run, over):
    ref = new_run({"model": over.get("model", {})}, name="ref")
    _run_float64(ref, 1)
    run = new_run(over)
    _run_float64(run, 2)
    a, b = train_records(ref), train_records(run)
    _same_numbers(a, b)
    assert [b[s]["phase"] for s in sorted(b)] == ["dense"] * 3 + ["warmup"] * 3 + ["sparse"] * 2
    assert all((b[s]["pp"], b[s]["dp"], b[s]["cp"]) == (2, 1, 1) for s in b)
    ea, eb = _evals(ref), _evals(run)
    assert len(ea) == len(eb) == 3 and max(abs(x - y) for x, y in zip(ea, eb)) < 1e-10
    assert "pp 2 x dp 1 x cp 1" in (run / "logs" / "rank1.log").read_text()


@pytest.mark.slow
def test_pp2_stop_resumes_bitwise_and_a_pp2_checkpoint_resumes_at_pp1(new_run):
    from test_train_crash_and_cli import _cli

    full = new_run(PP2, name="full")
    assert LocalLauncher().launch(full, progress=False).result.status == "completed"
    run = new_run(PP2)
    info = LocalLauncher().launch(run, max_steps=4, progress=False)  # inside the warm-up stage
    assert (info.result.status, info.result.step) == ("max_steps", 4)
    manifest = json.loads((run / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert (manifest["parallel"]["pp"], manifest["extra"]["pp_layout"], manifest["extra"]["vpp"]) == (2, "Et|ttmL", 1)
    assert LocalLauncher().launch(run, progress=False).result.status == "completed"
    assert losses(train_records(run)) == losses(train_records(full))

    other = new_run(PP2, name="other")
    assert LocalLauncher().launch(other, max_steps=4, progress=False).result.step == 4
    code, text = _cli("resume", str(other), "parallel.pp=1", "parallel.pp_layout=null", "--dry-run", "--json")
    assert code == 0, text
    report = json.loads(text[text.index("{"):text.rindex("}") + 1])
    verdicts = {i["aspect"]: i["verdict"] for i in report["items"]}
    assert report["ok"] and (verdicts["parallel.pp"], verdicts["parallel.dp"]) == ("reshard", "reshard"), verdicts
    code, text = _cli("resume", str(other), "parallel.pp=1", "parallel.pp_layout=null")
    assert code == 0, text
    recs = train_records(other)
    assert sorted(recs) == list(range(1, 9)) and all(recs[s]["pp"] == 1 and recs[s]["dp"] == 2 for s in range(5, 9))
    assert [(e["pp"], e["dp"], e["resharded"]) for e in _events(other, "layout")][-1] == (1, 2, True)


def test_plan_splits_the_world_into_pipeline_ranks_and_refuses_what_the_schedule_cannot_run(write_recipe):
    from v4launch.errors import ContractViolation
    from v4launch.training.plan import plan_curriculum
    from v4launch.training.recipe_io import load_recipe

    def plans(*over: str, world: int = 4):
        return plan_curriculum(load_recipe(write_recipe(), list(over)).recipe, world)

    got = plans("parallel.pp=2", "parallel.pp_layout=Et|ttmL", "parallel.global_batch_size=4")
    assert [(p.pp, p.dp, p.cp, p.accum) for p in got] == [(2, 2, 1, 2)] * 3
    with pytest.raises(ContractViolation, match="1 micro-batches per step, but the pipeline schedule over pp=2"):
        plans("parallel.pp=2", "parallel.pp_layout=Et|ttmL")  # global batch 2 over dp 2: one micro-batch
    with pytest.raises(ContractViolation, match="last virtual stage, with 'L'"):
        plans("parallel.pp=3", "parallel.pp_layout=Et|ttm|L", "parallel.global_batch_size=3", world=3)
    with pytest.raises(ContractViolation, match="needs parallel.pp_layout|stages but parallel.pp"):
        plans("parallel.pp=2", "parallel.global_batch_size=4")
    with pytest.raises(ContractViolation, match="does not divide the 2 ranks of a pipeline rank"):
        plans("parallel.pp=2", "parallel.pp_layout=Et|ttmL", "parallel.cp=4", "parallel.global_batch_size=4")
    got = plans("parallel.pp=2", "parallel.pp_layout=Et|ttmL", "parallel.global_batch_size=4", "parallel.ep=2",
                "parallel.distributed_optimizer=true")
    assert [(p.pp, p.dp) for p in got] == [(2, 2)] * 3
    with pytest.raises(ContractViolation, match="parallel.ep=4 does not divide the 2 ranks of a pipeline rank"):
        plans("parallel.pp=2", "parallel.pp_layout=Et|ttmL", "parallel.global_batch_size=4", "parallel.ep=4")
    with pytest.raises(ContractViolation, match="parallel.ep=3 does not divide model.moe.n_routed_experts=4"):
        plans("parallel.ep=3", "cluster.gpus_per_node=3", "parallel.global_batch_size=3", world=3)


def test_rank_grid_puts_cp_innermost_and_pp_outermost():
    from v4launch.training.dist import cp_group_ranks, pipeline_group_ranks

    assert cp_group_ranks(8, 2, pp=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cp_group_ranks(8, 4, pp=2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pipeline_group_ranks(8, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert pipeline_group_ranks(4, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="does not divide the 2 ranks of a pipeline rank"):
        cp_group_ranks(4, 4, pp=2)


OVER_BUDGET = {"pro_16n.yaml"}
"""Pro on 16 nodes: its layout runs, but no layout of 128 H200 holds the curriculum (V4-MEMORY)."""


@pytest.mark.parametrize("name", sorted(p.name for p in __import__("pathlib").Path(__file__).resolve()
                                        .parents[2].joinpath("recipes").glob("*.yaml")))
def test_every_shipped_recipe_validates_and_the_job_plans_it_as_written(name):
    """`validate` clean means the job's planner accepts the recipe at its own world size, pp, ep and
    distributed optimizer included (nothing flattened), and the seam's layout parses for its model."""
    from pathlib import Path

    from v4launch.model.parallel.pipeline import stage_specs
    from v4launch.training.plan import plan_curriculum
    from v4launch.recipe_loading import load_recipe
    from v4launch.validators import validate_recipe

    path = Path(__file__).resolve().parents[2] / "recipes" / name
    loaded = load_recipe(path, [])
    failed = validate_recipe(loaded).failed_rule_ids()
    # pro_16n does not fit the job's memory at its node count: validate says why (V4-MEMORY)
    assert failed == ({"V4-MEMORY"} if name in OVER_BUDGET else set()), failed
    recipe = loaded.recipe
    plans = plan_curriculum(recipe, recipe.cluster.world_size)
    par = recipe.parallel
    assert all(p.pp == par.pp and p.dp * p.cp * p.pp == recipe.cluster.world_size for p in plans)
    assert (recipe.cluster.world_size // par.pp) % par.ep == 0
    if par.pp * par.vpp > 1:
        m = recipe.model
        assert len(stage_specs(par.pp_layout, par.pp, par.vpp, m.n_layers, m.mtp.depth)) == par.pp * par.vpp
