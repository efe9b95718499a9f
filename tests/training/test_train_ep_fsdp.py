"""Expert parallelism and sharded data parallelism (FSDP2) in the training job: gloo processes, float64.

Every layout below trains the tiny recipe through dense -> warm-up (indexers built: a sharded model
is rebuilt and its state moved over by FQN) -> sparse and must give the one-process run's losses,
aux losses, gradient norms and held-out losses on the same data to 1e-10 (the workers build the model
in float64, as in test_train_cp.py / test_train_pp.py):

* ep 2 (world 2: two EP ranks of 2 experts each, dp 2);
* FSDP over dp 2 (``parallel.distributed_optimizer: true``);
* ep 2 x FSDP x cp 2 in the last stage (world 2: the sparse stage runs dp 1 x cp 2);
* pp 2 x ep 2 x FSDP (world 4: two pipeline ranks, each an S group of 2 ranks that are both the
  EP group and the FSDP group);
* ep 2 x FSDP with selective recompute of every region without collectives, and ep 2 x FSDP x cp 2
  with whole-layer recompute (granularity full: backward replays the expert all-to-all, the CP boundary
  exchange and the compressed all-gathers), both against plain data parallel without recompute:
  recompute changes memory, never numbers.

The manifests record ep and list every expert once; a checkpoint written at ep 2 x FSDP resumes
at ep 1 unsharded (DCP reshards by FQN) and continues with the uninterrupted run's losses.
"""

from __future__ import annotations

import json

import pytest
from test_train_cp import _events, _run_float64
from test_train_pp import _evals
from train_helpers import train_records

EP2 = {"cluster": {"gpus_per_node": 2}, "parallel": {"ep": 2}}
FSDP2 = {"cluster": {"gpus_per_node": 2}, "parallel": {"distributed_optimizer": True}}
EP2_FSDP_CP2 = {"cluster": {"gpus_per_node": 2}, "parallel": {"ep": 2, "distributed_optimizer": True},
                "curriculum": {"stages": [
                    {"name": "dense", "seq_len": 64, "phase": "dense", "steps": 3},
                    {"name": "warm", "seq_len": 64, "phase": "warmup", "steps": 3},
                    {"name": "sparse", "seq_len": 256, "phase": "sparse", "steps": 2, "cp": 2}]}}
EP2_FSDP_RECOMPUTE = {"cluster": {"gpus_per_node": 2}, "parallel": {
    "ep": 2, "distributed_optimizer": True, "recompute_granularity": "selective",
    "recompute_modules": ["layernorm", "mla_up_proj", "moe_act", "shared_experts"]}}
EP2_FSDP_CP2_FULL = {**EP2_FSDP_CP2, "parallel": {**EP2_FSDP_CP2["parallel"], "recompute_granularity": "full"}}
PP2_EP2_FSDP = {"cluster": {"gpus_per_node": 4},
                "parallel": {"pp": 2, "pp_layout": "Et|ttmL", "ep": 2, "distributed_optimizer": True,
                             "global_batch_size": 4}}


def _assert_same(a: dict, b: dict, tol: float = 1e-10) -> None:
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for s in sorted(a):
        assert set(b[s]["aux"]) == set(a[s]["aux"]), s
        assert b[s]["tokens"] == a[s]["tokens"], s
        pairs = [(a[s]["lm_loss"], b[s]["lm_loss"]), (a[s]["grad_norm"], b[s]["grad_norm"]),
                 *((a[s]["aux"][k], b[s]["aux"][k]) for k in a[s]["aux"])]
        worst = max(abs(x - y) / max(abs(x), 1e-30) for x, y in pairs)
        assert worst < tol, (s, worst)


_REFERENCES: dict[str, tuple[dict, list, set]] = {}
"""Reference results by (plain recipe, world): three of the six layouts share one reference, two another."""


def _reference(new_run, over: dict, world: int) -> tuple[dict, list, set]:
    """The same world and stages with every expert on every rank and no sharding (plain data parallel,
    itself equal to one process: test_train_cp.py, test_train_pp.py): (train records, held-out losses, the
    parameter names of the last checkpoint's optimizer groups), run once per distinct plain recipe."""
    dropped = ("ep", "distributed_optimizer", "recompute_granularity", "recompute_modules")
    plain = dict(over, parallel={k: v for k, v in over["parallel"].items() if k not in dropped})
    key = json.dumps([plain, world], sort_keys=True)
    if key not in _REFERENCES:
        ref = new_run(plain, name="ref")
        _run_float64(ref, world)
        _REFERENCES[key] = (train_records(ref), _evals(ref), _group_names(ref))
    return _REFERENCES[key]


def _group_names(run) -> set:
    manifest = json.loads(sorted((run / "checkpoints").glob("step_*/manifest.json"))[-1].read_text())
    return {n for g in manifest["extra"]["param_groups"].values() for n in g["names"]}


@pytest.mark.slow
@pytest.mark.parametrize("over,world", [(EP2, 2), (FSDP2, 2), (EP2_FSDP_CP2, 2), (PP2_EP2_FSDP, 4),
                                        (EP2_FSDP_RECOMPUTE, 2), (EP2_FSDP_CP2_FULL, 2)],
                         ids=["ep2", "fsdp-dp2", "ep2-fsdp-cp2", "pp2-ep2-fsdp", "ep2-fsdp-recompute",
                              "ep2-fsdp-cp2-full-recompute"])
def test_layout_gives_the_one_process_losses_in_float64(new_run, over, world):
    a, ea, ref_names = _reference(new_run, over, world)
    run = new_run(over)
    _run_float64(run, world)
    b = train_records(run)
    _assert_same(a, b)
    assert [b[s]["phase"] for s in sorted(b)] == ["dense"] * 3 + ["warmup"] * 3 + ["sparse"] * 2
    eb = _evals(run)
    assert len(ea) == len(eb) == 3 and max(abs(x - y) for x, y in zip(ea, eb)) < 1e-10
    manifest = json.loads(sorted((run / "checkpoints").glob("step_*/manifest.json"))[-1].read_text())
    assert manifest["parallel"]["ep"] == over["parallel"].get("ep", 1)
    names = _group_names(run)
    assert names == ref_names and any(".ffn.experts.3." in n for n in names), "every expert listed once"
    start = (run / "logs" / "rank1.log").read_text()
    if over["parallel"].get("ep", 1) > 1:
        assert "x ep 2 (experts 2-3 of 4 here)" in start
    if over["parallel"].get("distributed_optimizer"):
        assert "FSDP2 over the 2 ranks of a pipeline rank" in start
    if over["parallel"].get("recompute_modules"):
        assert "recompute layernorm, mla_up_proj, moe_act, shared_experts:" in start
    if over["parallel"].get("recompute_granularity") == "full":
        assert "recompute full:" in start and "replaying the CP boundary exchange" in start
        assert "the expert all-to-all (ep=2)" in start


@pytest.mark.slow
def test_an_ep2_fsdp_checkpoint_resumes_at_ep1_unsharded(new_run):
    """Stopped inside the warm-up stage (after the sharded model's rebuild), resumed with every expert on
    every rank and nothing sharded: DCP reshards by FQN, the resume report says so, and the continuation
    starts from the saved weights (step 5's loss, computed with them, equals the uninterrupted run's)."""
    from test_train_crash_and_cli import _cli

    from v4launch.launchers import LocalLauncher

    over = {"cluster": {"gpus_per_node": 2}, "parallel": {"ep": 2, "distributed_optimizer": True}}
    full = new_run(over, name="full")
    assert LocalLauncher().launch(full, progress=False).result.status == "completed"
    run = new_run(over)
    info = LocalLauncher().launch(run, max_steps=4, progress=False)
    assert (info.result.status, info.result.step) == ("max_steps", 4)
    manifest = json.loads((run / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert (manifest["parallel"]["ep"], manifest["extra"]["model_phase"]) == (2, "warmup")
    overrides = ("parallel.ep=1", "parallel.distributed_optimizer=false")
    code, text = _cli("resume", str(run), *overrides, "--dry-run", "--json")
    assert code == 0, text
    report = json.loads(text[text.index("{"):text.rindex("}") + 1])
    verdicts = {i["aspect"]: i["verdict"] for i in report["items"]}
    assert report["ok"] and verdicts["parallel.ep"] == "reshard", verdicts
    code, text = _cli("resume", str(run), *overrides)
    assert code == 0, text
    a, b = train_records(full), train_records(run)
    assert sorted(b) == list(range(1, 9))
    assert abs(a[5]["lm_loss"] - b[5]["lm_loss"]) < 1e-5 * abs(a[5]["lm_loss"])
    assert all(abs(a[s]["lm_loss"] - b[s]["lm_loss"]) < 1e-2 * abs(a[s]["lm_loss"]) for s in range(5, 9))
    assert [(e["ep"], e["dp"], e["resharded"]) for e in _events(run, "layout")][-1] == (1, 2, True)


@pytest.mark.slow
def test_held_out_loss_is_over_the_same_documents_whatever_dp(new_run):
    """Eight global held-out micro-batches, dealt over the dp replicas: dp 2 evaluates what dp 1 does."""
    ref = new_run(name="ref")
    _run_float64(ref, 1)
    run = new_run({"cluster": {"gpus_per_node": 2}, "parallel": {"ep": 2}})
    _run_float64(run, 2)
    ea, eb = _evals(ref), _evals(run)
    assert len(ea) == len(eb) == 3 and max(abs(x - y) for x, y in zip(ea, eb)) < 1e-10


@pytest.mark.slow
def test_an_ep2_fsdp_run_stopped_after_the_rebuild_resumes_bitwise(new_run):
    """Stopped in the warm-up stage (after the sharded model was rebuilt with its indexers) and resumed at the
    same layout, the run continues with exactly the uninterrupted run's numbers (the resume builds the
    model in the checkpoint's phase and loads every FQN; the uninterrupted run moved its state by FQN)."""
    from train_helpers import assert_resume_is_bitwise

    over = {"cluster": {"gpus_per_node": 2}, "parallel": {"ep": 2, "distributed_optimizer": True}}
    assert_resume_is_bitwise(new_run, over, stop_at=5)
