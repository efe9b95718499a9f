"""The training step reads device values back once, after the optimizer step and the router-bias update
are queued: a read earlier in the step (the loss sums after the backward, the gradient norm before the
update) makes the host wait for the GPU to finish the backward before it can queue the optimizer. The
read is only queued there (``step.PendingStats``): the job reads a step's statistics after it has queued
the next step (tests/training/test_train_data_and_metrics.py checks the job's order)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from v4launch.model import ModelArgs, V4Model
from v4launch.model.parallel.data_parallel import scale_grads
from v4launch.training import step as step_mod
from v4launch.training.dist import DistInfo
from v4launch.training.step import LossWeights

ARGS = ModelArgs(vocab_size=96, dim=32, n_layers=2, n_mtp_layers=1, compress_ratios=(0, 4, 0), n_heads=2,
                 head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, window_size=8,
                 index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4, n_activated_experts=2,
                 moe_inter_dim=16, n_hash_layers=1, hc_mult=2)


class _Batch:
    def __init__(self, gen: torch.Generator, lengths: list[int]):
        T = sum(lengths)
        self.tokens = torch.randint(0, ARGS.vocab_size, (T,), generator=gen)
        self.cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        self.max_seqlen = max(lengths)
        self.labels = torch.cat([self.tokens[1:], self.tokens.new_full((1,), -100)])
        self.labels[self.cu_seqlens[1:].long() - 1] = -100
        self.num_real_tokens = T


class _Optimizer:
    """AdamW behind the step's interface, recording when it runs."""

    def __init__(self, model: V4Model, events: list[str]):
        self.inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.params = [p for g in self.inner.param_groups for p in g["params"]]
        self.events = events

    def step(self, clip: torch.Tensor | None = None) -> None:  # Optimizers.step's interface: the clip applied here
        self.events.append("optimizer step")
        if clip is not None:
            scale_grads([p.grad for p in self.params if p.grad is not None], clip)
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)


@pytest.mark.parametrize("accum", [1, 3])
def test_the_step_queues_its_one_read_after_the_update_and_reads_only_when_asked(monkeypatch, accum):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,))))
    torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=gen)))
    model = V4Model(ARGS, "sparse").double()
    events: list[str] = []
    reads: list[dict] = []

    class RecordedRead(step_mod.QueuedRead):
        def __init__(self, values):
            events.append("queue")
            super().__init__(values)

        def values(self):
            events.append("read")
            got = super().values()
            reads.append(dict(got))  # the step pops the norm from the dict it gets
            return got

    real_bias = model.update_router_bias
    monkeypatch.setattr(step_mod, "QueuedRead", RecordedRead)
    monkeypatch.setattr(model, "update_router_bias", lambda speed: (events.append("router bias"), real_bias(speed)))
    batches = [_Batch(gen, [20, 13, 31]) for _ in range(accum)]
    # the losses the step must report: the micro-batches' mean, computed here on the same weights
    with torch.no_grad():
        outs = [model(b.tokens, b.cu_seqlens, b.max_seqlen, b.labels) for b in batches]
    want_lm = sum(float(o.lm_loss) for o in outs) / accum
    info = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    pending = step_mod.queue_step(model, _Optimizer(model, events), batches, accum=accum,
                                  weights=LossWeights(indexer_kl=1.0, balance=1e-4, mtp=0.3), grad_clip=1.0,
                                  bias_speed=1e-3, info=info, autocast=contextlib.nullcontext)
    assert events == ["optimizer step", "router bias", "queue"], events  # queued last, nothing read yet
    stats = pending.result()
    assert events[-1] == "read" and events.count("read") == 1
    assert abs(stats.lm_loss - want_lm) <= 1e-12 * abs(want_lm)
    assert stats.grad_norm > 0 and stats.grad_norm == reads[0][step_mod._GRAD_NORM]
    assert set(stats.aux) == set(outs[0].aux_losses)
    assert stats.tokens == accum * 64
