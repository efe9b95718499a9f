"""Bad data trains without error; the metrics file has every aux loss; CP planning and schedule checks."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import train_records

from v4launch.errors import ContractViolation
from v4launch.model import V4Model
from v4launch.rundir import load_run
from v4launch.training.job import train
from v4launch.training.model_adapter import model_args_from_recipe
from v4launch.training.plan import LRSchedule, plan_curriculum


def test_bad_documents_train_without_error(workspace, new_run):
    bad = workspace / "bad"
    bad.mkdir()
    (bad / "empty.txt").write_text("")
    for i in range(6):
        (bad / f"short{i}.txt").write_text("ab"[: i % 3])  # shorter than the CSA ratio (and empty)
    (bad / "long.txt").write_text("def f(x):\n    return x * 2\n" * 40)  # ~1100 bytes > seq_len 64 and 128
    (bad / "mid.txt").write_text("print('hello world')\n" * 3)
    run = new_run({"data": {"paths": [str(bad)], "validation_fraction": 0.0}})
    result = train(run, progress=False)
    assert result.status == "completed"
    recs = train_records(run)
    assert all(torch.isfinite(torch.tensor(r["lm_loss"])) for r in recs.values())


def test_full_rows_leave_a_step_short_only_where_the_data_epoch_ends(workspace, new_run):
    """data.packing=fill_rows on three short documents (an epoch every few steps): every step holds
    global_batch x seq_len real tokens except one holding an epoch's end, which data_epoch marks."""
    text = workspace / "three"
    text.mkdir()
    for i, n in enumerate((70, 95, 121)):
        (text / f"doc{i}.txt").write_text("".join(chr(97 + (i * 7 + k) % 26) for k in range(n)))
    run = new_run({"data": {"paths": [str(text)], "packing": "fill_rows", "validation_fraction": 0.0},
                   "logging": {"interval_steps": 1},
                   "curriculum": {"stages": [{"name": "dense", "seq_len": 64, "phase": "dense", "steps": 10}]}})
    train(run, progress=False)
    full = load_run(run).recipe.parallel.global_batch_size * 64
    recs = train_records(run)
    steps = sorted(recs)
    epochs = [recs[s]["data_epoch"] for s in steps]
    got = [recs[s]["tokens"] - (recs[s - 1]["tokens"] if s > 1 else 0) for s in steps]
    assert epochs[0] == 0 and epochs == sorted(epochs) and epochs[-1] >= 2, epochs
    short = [i for i, n in enumerate(got) if n < full]
    assert short and max(got) == full, got
    for i in short:  # its last row ends epoch e: the next step starts e + 1, or its own second row already did
        ends_here = i + 1 < len(epochs) and epochs[i + 1] > epochs[i]
        began_here = i > 0 and epochs[i] > epochs[i - 1]
        assert ends_here or began_here or i == len(epochs) - 1, (i, got, epochs)


def test_metrics_hold_every_aux_loss_the_model_returns(new_run):
    run = new_run()
    train(run, progress=False)
    recipe = load_run(run).recipe
    recs = train_records(run)
    model = V4Model(model_args_from_recipe(recipe), phase="sparse")
    tokens = torch.randint(0, 256, (64,))
    out = model(tokens, torch.tensor([0, 64], dtype=torch.int32), 64, tokens.roll(-1))
    sparse = [r for r in recs.values() if r["phase"] == "sparse"]
    assert sparse and all(set(r["aux"]) == set(out.aux_losses) for r in sparse)
    dense = [r for r in recs.values() if r["phase"] == "dense"]
    assert all(not any(k.startswith("indexer_kl/") for k in r["aux"]) for r in dense)
    for r in recs.values():
        assert set(r["aux_sum"]) == {n.split("/")[0] for n in r["aux"]}
        for key in ("stage", "phase", "step", "tokens", "lr", "lm_loss", "total_loss", "grad_norm", "tokens_per_s",
                    "elapsed_s"):
            assert key in r
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["new"] for e in lines if e["kind"] == "event" and e["event"] == "phase"] == ["warmup", "sparse"]
    assert len([e for e in lines if e["kind"] == "eval"]) == 3
    log = (run / "logs" / "rank0.log").read_text()
    assert "kl " in log and "bal " in log and "mtp " in log


def test_indexer_kl_falls_during_warmup(new_run):
    run = new_run({"curriculum": {"stages": [
        {"name": "dense", "seq_len": 128, "phase": "dense", "steps": 1},
        {"name": "warm", "seq_len": 128, "phase": "warmup", "steps": 12}]},
        "attention": {"indexer_loss_coeff": 1.0}})
    train(run, progress=False)
    kl = [r["aux_sum"]["indexer_kl"] for r in train_records(run).values() if r["phase"] == "warmup"]
    assert sum(kl[-3:]) / 3 < sum(kl[:3]) / 3


def test_cp_stage_plans_dp_times_cp_and_refuses_what_the_job_cannot_run(write_recipe):
    from v4launch.training.recipe_io import load_recipe

    over = ["curriculum.stages.2.cp=2", "curriculum.stages.2.seq_len=256", "cluster.gpus_per_node=2"]
    plans = plan_curriculum(load_recipe(write_recipe(), over).recipe, 2)
    assert [(p.dp, p.cp, p.accum) for p in plans] == [(2, 1, 1), (2, 1, 1), (1, 2, 2)]
    with pytest.raises(ContractViolation, match="'sparse'.*cp=2 does not divide the world size 1"):
        plan_curriculum(load_recipe(write_recipe(), over).recipe, 1)
    short = load_recipe(write_recipe(), ["curriculum.stages.2.cp=2", "cluster.gpus_per_node=2"]).recipe
    with pytest.raises(ContractViolation, match="'sparse'.*128 packed tokens.*boundary width 128"):
        plan_curriculum(short, 2)  # 64 local rows < max(window 16, HCA context 128)
    fused = load_recipe(write_recipe(), [*over, "curriculum.stages.2.kernel_backend=triton"]).recipe
    assert [(p.cp, p.kernel_backend) for p in plan_curriculum(fused, 2)][2] == (2, "triton")  # CP runs the kernels


def test_tokens_budget_and_lr_schedule(write_recipe):
    from v4launch.training.recipe_io import load_recipe

    r = load_recipe(write_recipe(), ["curriculum.stages.1.steps=null", "curriculum.stages.1.tokens=300",
                                     "curriculum.stages.2.lr=1e-3"]).recipe
    plans = plan_curriculum(r, 1)
    assert [p.steps for p in plans] == [3, 3, 2]  # ceil(300 / (2 * 64)) = 3
    sched = LRSchedule(r.optimizer, plans)
    assert sched.lr(0)[0] == pytest.approx(1.5e-3) and sched.lr(1)[0] == pytest.approx(3e-3)
    assert sched.lr(7)[0] <= 1e-3 and sched.lr(7)[1] == pytest.approx(sched.lr(7)[0] * 2e-2 / 3e-3)
    assert not sched.decay_started(1) and sched.decay_started(2)


def test_stage_kernel_backend_reaches_the_model_and_the_log_says_what_runs(new_run):
    run = new_run({"curriculum": {"stages": [
        {"name": "dense", "seq_len": 128, "phase": "dense", "steps": 1},
        {"name": "warm", "seq_len": 128, "phase": "warmup", "steps": 1, "kernel_backend": "triton"}]}})
    assert train(run, progress=False).status == "completed"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    kernels = [(e["requested"], e["running"]) for e in lines if e["kind"] == "event" and e["event"] == "kernels"]
    assert kernels == [("reference", "reference"), ("triton", "reference")]  # CPU: no SM90, says so
    assert "not a CUDA GPU" in (run / "logs" / "rank0.log").read_text()
