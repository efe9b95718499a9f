"""The job reads each step's statistics one step late (``step.PendingStats``, ``Runner.flush_stats``), and the
data path checks token ids on the host (``data_io.to_device``), so that on a GPU the host builds and queues
step N + 1 while the device still runs step N.

What must hold whatever the device: step N's statistics are read after step N + 1 is queued inside a stage,
before every checkpoint, evaluation and halt; each step is read and logged once, in order; the manifest
counts the tokens of every step it covers; and the logged values are the step's own (the same as reading
at once, which the eager-vs-compiled and resume tests compare elsewhere).
"""

from __future__ import annotations

import pytest
import torch
from train_helpers import train_records

from v4launch.data.packing import PackedBatch
from v4launch.errors import UsageError
from v4launch.model import ModelArgs, V4Model
from v4launch.model import model as model_mod
from v4launch.training import data_io
from v4launch.training import runner as runner_mod
from v4launch.training.job import train


def test_each_step_is_read_after_the_next_is_queued_and_before_every_checkpoint(new_run, monkeypatch):
    events: list[tuple[str, int]] = []
    queued = [0]
    real_queue, real_save, real_eval = runner_mod.queue_step, runner_mod.save_checkpoint, runner_mod.evaluate

    def queue_step(*args, **kwargs):
        pending = real_queue(*args, **kwargs)
        queued[0] += 1
        step = queued[0]
        events.append(("queue", step))
        real_result = pending.result

        def result():
            events.append(("read", step))
            return real_result()

        pending.result = result
        return pending

    def save_checkpoint(root, step, *args, **kwargs):
        events.append(("save", step))
        return real_save(root, step, *args, **kwargs)

    def evaluate(*args, **kwargs):
        events.append(("eval", queued[0]))
        return real_eval(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "queue_step", queue_step)
    monkeypatch.setattr(runner_mod, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(runner_mod, "evaluate", evaluate)
    run_dir = new_run({"checkpointing": {"interval_steps": 2, "keep_last": 10}})  # stages of 3, 3 and 2 steps
    result = train(run_dir, progress=False)
    assert result.status == "completed" and queued[0] == 8

    order = {e: i for i, e in enumerate(events)}
    assert [s for kind, s in events if kind == "read"] == list(range(1, 9))  # each step read once, in order
    for step in (1, 5, 7):  # no checkpoint or stage end after it: read only once the next step is queued
        assert order[("queue", step + 1)] < order[("read", step)], events
    for kind, step in events:
        if kind in ("save", "eval"):  # a checkpoint or evaluation at step N comes after step N's read
            assert order[("read", step)] < order[(kind, step)], events
    assert [s for kind, s in events if kind == "save"] == [2, 3, 4, 6, 8]

    records = train_records(run_dir)
    assert sorted(records) == list(range(1, 9))
    tokens = [records[s]["tokens"] for s in range(1, 9)]
    assert all(b > a for a, b in zip(tokens, tokens[1:]))  # cumulative, each step counted once
    assert all(records[s]["step_time_s"] > 0 and records[s]["tokens_per_s"] > 0 for s in records)
    # a stage's last step is read right after it is queued: its time is still its own work (on the CPU, where
    # the step runs synchronously, the read-to-read interval was about zero and gave ~10^6 tokens/s)
    times = sorted(records[s]["step_time_s"] for s in records)
    assert all(records[s]["step_time_s"] >= 0.25 * times[len(times) // 2] for s in (3, 6, 8)), records
    import json

    manifest = json.loads((run_dir / "checkpoints" / "step_00000008" / "manifest.json").read_text())
    assert manifest["tokens_consumed"] == records[8]["tokens"]


def _batch(tokens: list[int], labels: list[int]) -> PackedBatch:
    n = len(tokens)
    return PackedBatch(tokens=torch.tensor(tokens), labels=torch.tensor(labels),
                       cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n, num_docs=1,
                       num_real_tokens=n)


def test_the_data_path_checks_ids_on_the_host_and_marks_the_batch():
    vocab = 50
    ok = data_io.to_device(_batch([1, 2, 49], [2, 49, -100]), torch.device("cpu"), vocab)
    assert ok.ids_checked
    with pytest.raises(UsageError, match=r"model.vocab_size = 50: tokens.*range \[1, 50\].*\[0, 50\)") as err:
        data_io.to_device(_batch([1, 50, 3], [50, 3, -100]), torch.device("cpu"), vocab)
    assert "model.vocab_size" in err.value.hint and "data.tokenizer" in err.value.hint
    with pytest.raises(UsageError, match=r"labels.*value -7"):
        data_io.to_device(_batch([1, 2, 3], [2, -7, -100]), torch.device("cpu"), vocab)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_batch_reaches_the_gpu_from_page_locked_memory():
    """A copy from pageable memory may make the driver wait for the stream's queued work (the previous step):
    from the second batch on, every host -> device copy of a batch and its tables is from page-locked memory."""
    from torch.profiler import ProfilerActivity, profile

    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_mtp_layers=0, compress_ratios=(0, 4), n_heads=2,
                     head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, window_size=8,
                     index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4, n_activated_experts=2,
                     moe_inter_dim=16, n_hash_layers=0, hc_mult=2)
    model = V4Model(args, "dense").cuda()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    tokens = torch.randint(0, 64, (8192,), generator=gen)
    batch = _batch(tokens.tolist(), tokens[1:].tolist() + [-100])
    # the first batch on a device copies each layer's RoPE inverse frequencies there once (rope.inv_freq_on, from
    # pageable memory): a one-time copy, not a per-step one. Steady state is the second batch on.
    warm = data_io.to_device(batch, torch.device("cuda"), 64)
    model.batch_context(warm.tokens, warm.cu_seqlens, warm.max_seqlen, warm.labels, static_seqlen=8192,
                        ids_checked=warm.ids_checked)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = data_io.to_device(batch, torch.device("cuda"), 64)
        model.batch_context(out.tokens, out.cu_seqlens, out.max_seqlen, out.labels, static_seqlen=8192,
                            ids_checked=out.ids_checked)  # copies cu_seqlens itself
        torch.cuda.synchronize()
    copies = [e.key for e in prof.key_averages() if e.key.startswith("Memcpy HtoD")]
    assert len(copies) >= 1 and not any("Pageable" in k for k in copies), copies
    assert out.tokens.is_cuda and torch.equal(out.tokens.cpu(), batch.tokens) and out.ids_checked
    assert out.cu_seqlens.device.type == "cpu" and out.cu_seqlens.is_pinned()


def test_the_model_skips_its_own_id_check_only_for_a_checked_batch(monkeypatch):
    args = ModelArgs(vocab_size=64, dim=32, n_layers=1, n_mtp_layers=0, compress_ratios=(0,), n_heads=2,
                     head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, window_size=8,
                     n_routed_experts=4, n_activated_experts=2, moe_inter_dim=16, n_hash_layers=0, hc_mult=2)
    model = V4Model(args, "dense")
    calls: list[int] = []
    real = model_mod.check_ids
    monkeypatch.setattr(model_mod, "check_ids", lambda t, lab, v: (calls.append(v), real(t, lab, v)))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    tokens = torch.randint(0, 64, (24,), generator=gen)
    cu = torch.tensor([0, 24], dtype=torch.int32)
    model.batch_context(tokens, cu, 24, tokens)
    assert calls == [64]
    model.batch_context(tokens, cu, 24, tokens, ids_checked=True)
    assert calls == [64]  # not again
    with pytest.raises(ValueError, match="tokens"):  # unchecked: a bad id still gets the clear error
        model.batch_context(tokens + 64, cu, 24, tokens)


def test_a_non_finite_step_stops_the_job_before_anything_is_saved(new_run, monkeypatch):
    """Weights turned NaN before step 3: the job raises at step 3's read, names the step and the newest
    checkpoint (step 2), and saves nothing after it; keep_last=1 would otherwise have replaced the good one."""
    from v4launch.errors import TrainingDiverged

    real_queue = runner_mod.queue_step
    queued = [0]

    def queue_step(model, *args, **kwargs):
        queued[0] += 1
        if queued[0] == 3:
            with torch.no_grad():
                next(p for n, p in model.named_parameters() if n.endswith("attn_norm.weight")).fill_(float("nan"))
        return real_queue(model, *args, **kwargs)

    monkeypatch.setattr(runner_mod, "queue_step", queue_step)
    run_dir = new_run({"checkpointing": {"interval_steps": 2, "keep_last": 1},
                       "curriculum": {"stages": [{"name": "dense", "seq_len": 64, "phase": "dense", "steps": 6}]}})
    with pytest.raises(TrainingDiverged, match=r"step 3 \(stage dense.*lm_loss = nan.*step_00000002") as err:
        train(run_dir, progress=False)
    assert "optimizer.lr" in err.value.hint
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
    records = train_records(run_dir)
    assert max(records) == 3 and records[2]["lm_loss"] == records[2]["lm_loss"]  # step 2 finite, step 3 logged
    import json

    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (diverged,) = [e for e in events if e.get("event") == "diverged"]
    assert diverged["step"] == 3 and "lm_loss" in diverged["values"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_that_reads_the_host_inside_is_timed_by_its_device_work(new_run, monkeypatch):
    """A step that waits for the device inside (the warm-up's dense KL reads its chunk ranges on the host) lets
    the device finish the previous step and most of this one while the host is still queueing it; timed by host
    clocks, a stage's last step, read at once, was credited with its tail alone (3 ms, 2.7 million tokens/s for
    an 8,192-token warm-up step on an H200). Each step here has 2 x ~100 ms of device sleep around a host wait
    (``torch.cuda._sleep`` before and after a ``synchronize``, ahead of the step's read): every step's time must
    hold both (host-clock timing gave the steps read at once about one)."""
    from v4launch.training import step as step_mod

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 10 ** 7
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    cycles = int(probe * 100.0 / a.elapsed_time(b))  # ~100 ms of device sleep
    real_read = step_mod.QueuedRead

    def read_after_a_host_wait(values):
        torch.cuda._sleep(cycles)  # work the host waits for inside the step
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)  # work still running when the host starts the next step
        return real_read(values)

    monkeypatch.setattr(step_mod, "QueuedRead", read_after_a_host_wait)
    run_dir = new_run({"cluster": {"gpu": "H200"}, "checkpointing": {"interval_steps": 2, "keep_last": 10}})
    assert train(run_dir, progress=False).status == "completed"
    records = train_records(run_dir)
    assert sorted(records) == list(range(1, 9))
    short = {s: round(r["step_time_s"], 3) for s, r in records.items() if r["step_time_s"] < 0.19}
    assert not short, f"steps timed below their 0.2 s of device work: {short}"
