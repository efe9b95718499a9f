"""Context parallelism in the training job: two gloo processes, ranks laid out [dp][cp].

* A CP = 2 run gives the losses of the CP = 1 run on the same data. Compared in float64 (the
  job is fp32/bf16; the test's workers build the model in float64), where every loss and the
  gradient norm agree to 1e-10 over dense, warm-up and sparse steps. In float32 only the first
  step agrees to ~1e-6: the CP partial sums change the rounding and the optimizer (Adam's
  normalised first update, top-k routing) amplifies it to ~1e-4 within a few steps.
* A checkpoint saved at cp = 1 / dp = 2 resumes into a cp = 2 / dp = 1 stage through the
  reshard verdict, bitwise identical to an uninterrupted run; so does a stop inside the CP stage.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from train_helpers import TINY, _merge, corpus, losses, train_records

from v4launch.launchers import LocalLauncher

# window 16 and an HCA layer: boundary width 128, so a CP = 2 stage needs seq_len >= 256
CP_STAGES = [{"name": "dense", "seq_len": 256, "phase": "dense", "steps": 3},
             {"name": "warm", "seq_len": 256, "phase": "warmup", "steps": 3},
             {"name": "sparse", "seq_len": 256, "phase": "sparse", "steps": 2}]
# world 2: dense and warm-up as dp 2 x cp 1 (short sequences), then the sparse stage as dp 1 x cp 2
SWITCH = {"cluster": {"gpus_per_node": 2}, "parallel": {"global_batch_size": 2}, "curriculum": {"stages": [
    {"name": "dense", "seq_len": 64, "phase": "dense", "steps": 3},
    {"name": "warm", "seq_len": 64, "phase": "warmup", "steps": 3},
    {"name": "sparse", "seq_len": 256, "phase": "sparse", "steps": 3, "cp": 2}]}}

FLOAT64_WORKER = textwrap.dedent("""
    import sys
    import v4launch.training.runner as runner
    build = runner.V4Model
    runner.V4Model = lambda *a, **k: build(*a, **k).double()   # parameters, optimizer state, grads: float64
    from v4launch.training.job import train
    train(sys.argv[1], progress=False)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_float64(run: Path, world: int) -> None:
    """The job on ``world`` gloo processes (the local launcher's environment), model in float64."""
    env = dict(os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", FLOAT64_WORKER, str(run)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)


def _events(run: Path, kind: str) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "event" and r["event"] == kind]


@pytest.mark.slow
def test_cp2_gives_the_cp1_losses_in_float64(new_run):
    ref = new_run({"curriculum": {"stages": CP_STAGES}})
    _run_float64(ref, 1)
    run = new_run({"curriculum": {"stages": CP_STAGES}, "cluster": {"gpus_per_node": 2}, "parallel": {"cp": 2}})
    _run_float64(run, 2)
    a, b = train_records(ref), train_records(run)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert [b[s]["phase"] for s in sorted(b)] == ["dense"] * 3 + ["warmup"] * 3 + ["sparse"] * 2
    for s in sorted(a):
        assert (b[s]["dp"], b[s]["cp"], a[s]["cp"]) == (1, 2, 1)
        assert b[s]["tokens"] == a[s]["tokens"], "each token is counted once under CP"
        assert set(b[s]["aux"]) == set(a[s]["aux"])
        pairs = [(a[s]["lm_loss"], b[s]["lm_loss"]), (a[s]["grad_norm"], b[s]["grad_norm"]),
                 *((a[s]["aux"][k], b[s]["aux"][k]) for k in a[s]["aux"])]
        assert max(abs(x - y) for x, y in pairs) < 1e-10, s
    evals = [[json.loads(x)["lm_loss"] for x in (r / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "eval"] for r in (ref, run)]
    assert len(evals[0]) == 3 and max(abs(x - y) for x, y in zip(*evals)) < 1e-10
    assert "dp 1 x cp 2" in (run / "logs" / "rank1.log").read_text()


@pytest.fixture(scope="module")
def switch_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted two-process run of SWITCH (dp 2 x cp 1, then dp 1 x cp 2), in its own workspace
    (built once for the tests that compare against it)."""
    import yaml

    from v4launch.rundir import create_run_dir
    from v4launch.training.recipe_io import load_recipe
    from v4launch.workspace import Workspace

    ws = tmp_path_factory.mktemp("reference")
    (ws / ".v4launch").mkdir()
    corpus(ws / "text")
    path = ws / "reference.yaml"
    path.write_text(yaml.safe_dump(_merge(_merge(TINY, {"data": {"paths": [str(ws / "text")]}}), SWITCH),
                                   sort_keys=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ws)
        mp.delenv("WORLD_SIZE", raising=False)
        ref = create_run_dir(load_recipe(path), "local", {}, workspace=Workspace(ws))
        info = LocalLauncher().launch(ref, progress=False)
    assert (info.result.status, info.result.step) == ("completed", 9)
    return ref


@pytest.mark.slow
def test_checkpoint_at_cp1_dp2_resumes_at_cp2_through_reshard_bitwise(new_run, switch_reference):
    from test_train_crash_and_cli import _cli

    ref = switch_reference
    recs = train_records(ref)
    assert [(recs[s]["dp"], recs[s]["cp"]) for s in sorted(recs)] == [(2, 1)] * 6 + [(1, 2)] * 3
    assert [(e["dp"], e["cp"], e["step"]) for e in _events(ref, "layout")] == [(1, 2, 6)]
    run = new_run(SWITCH)
    info = LocalLauncher().launch(run, max_steps=6, progress=False)  # ends at the warm-up stage's end
    assert (info.result.status, info.result.step) == ("max_steps", 6)
    manifest = json.loads((run / "checkpoints" / "step_00000006" / "manifest.json").read_text())
    assert (manifest["parallel"]["world"], manifest["parallel"]["dp"], manifest["parallel"]["cp"]) == (2, 2, 1)
    code, text = _cli("resume", str(run), "--dry-run", "--json")
    assert code == 0, text
    report = json.loads(text[text.index("{"):text.rindex("}") + 1])
    assert report["ok"] and report["needs_reshard"] and report["target"] == "stage #2 sparse (sparse)"
    verdicts = {i["aspect"]: i["verdict"] for i in report["items"]}
    assert (verdicts["parallel.dp"], verdicts["parallel.cp"], verdicts["parallel.world"]) == ("reshard", "reshard",
                                                                                              "safe")
    code, text = _cli("resume", str(run))
    assert code == 0, text
    last = json.loads((run / "checkpoints" / "step_00000009" / "manifest.json").read_text())
    assert (last["parallel"]["dp"], last["parallel"]["cp"]) == (1, 2)
    assert losses(train_records(run)) == losses(recs)
    # the resumed process logs the change from the checkpoint's layout, once
    layout = _events(run, "layout")
    assert [(e["dp"], e["cp"], e["step"], e["resharded"]) for e in layout] == [(1, 2, 6, True)]


@pytest.mark.slow
def test_two_process_stop_inside_the_cp_stage_resumes_bitwise(new_run, switch_reference):
    run = new_run(SWITCH)
    for k in (2, 7):  # mid dense (dp 2 x cp 1), then one step into the CP stage (dp 1 x cp 2)
        info = LocalLauncher().launch(run, max_steps=k, progress=False)
        assert (info.result.status, info.result.step) == ("max_steps", k)
    assert LocalLauncher().launch(run, progress=False).result.status == "completed"
    recs = train_records(run)
    assert losses(recs) == losses(train_records(switch_reference))
    # one real change (at the stage boundary, inside the second process); resuming inside the CP stage
    # from a dp 1 x cp 2 checkpoint is no change and logs none
    assert [(e["dp"], e["cp"], e["step"], e["resharded"]) for e in _events(run, "layout")] == [(1, 2, 6, False)]
    steps = [recs[s]["tokens"] - recs.get(s - 1, {"tokens": 0})["tokens"] for s in sorted(recs)]
    assert all(0 < t <= 2 * 64 for t in steps[:6]) and all(2 * 128 < t <= 2 * 256 for t in steps[6:]), steps


def test_rank_layout_is_dp_major_with_contiguous_cp_groups_and_the_world_sum_over_dp_is_cp_sum_dp_mean():
    import torch

    from v4launch.training.dist import cp_group_ranks, dp_group_ranks

    assert cp_group_ranks(4, 2) == [[0, 1], [2, 3]] and dp_group_ranks(4, 2) == [[0, 2], [1, 3]]
    assert cp_group_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]] and dp_group_ranks(2, 1) == [[0, 1]]
    assert cp_group_ranks(2, 2) == [[0, 1]] and dp_group_ranks(2, 2) == [[0], [1]]
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        cp_group_ranks(4, 3)
    world, cp = 8, 4
    dp = world // cp
    g = torch.randn(world, 5, dtype=torch.float64)  # g[rank]: rank = dp_rank * cp + cp_rank
    cp_sum = {r: sum(g[q] for q in group) for group in cp_group_ranks(world, cp) for r in group}
    cp_then_dp = {r: sum(cp_sum[q] for q in group) / dp for group in dp_group_ranks(world, cp) for r in group}
    for r in range(world):
        torch.testing.assert_close(cp_then_dp[r], g.sum(0) / dp)
