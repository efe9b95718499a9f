"""Expert-parallel API without several processes: errors, the rank-major -> expert-major gather,
the single-device dispatcher, pruning and parameter names (one-rank gloo group)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/model (v4_helpers)

from v4_helpers import build, packed_batch, tiny_args  # noqa: E402

from v4launch.model import V4Model  # noqa: E402
from v4launch.model.moe import MoE  # noqa: E402
from v4launch.model.parallel import (SINGLE_DEVICE_EXPERTS, ExpertParallelDispatch,  # noqa: E402
                                     apply_expert_parallel, expert_parameter_names)
from v4launch.model.parallel.expert import expert_major_order  # noqa: E402


def test_experts_not_divisible_by_ep_raises_with_a_fix():
    with pytest.raises(ValueError, match=r"ep=3 with n_routed_experts=8.*Fix: choose parallel.ep from the divisors"):
        ExpertParallelDispatch(None, 3, 0, 8)
    with pytest.raises(ValueError, match=r"ep_rank=2: must be in \[0, 2\)"):
        ExpertParallelDispatch(None, 2, 2, 8)


def test_expert_major_order_regroups_rank_major_rows_by_expert():
    """recv[r, j] rows from rank r for local expert j; rows arrive ordered (r, j), are wanted as (j, r)."""
    recv = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 ranks, 3 local experts
    labels = [(r, j) for r in range(2) for j in range(3) for _ in range(int(recv[r, j]))]  # rank-major rows
    src = expert_major_order(recv, len(labels))
    got = [labels[i] for i in src.tolist()]
    assert got == sorted(labels, key=lambda rj: (rj[1], rj[0]))
    assert sorted(src.tolist()) == list(range(len(labels)))


def test_single_device_dispatcher_is_the_identity():
    x, counts = torch.randn(5, 3), torch.tensor([2, 3])
    x_local, local_counts, ctx = SINGLE_DEVICE_EXPERTS.dispatch(x, counts)
    assert x_local is x and local_counts is counts and SINGLE_DEVICE_EXPERTS.combine(x, ctx) is x
    assert MoE(1, tiny_args()).dispatcher is SINGLE_DEVICE_EXPERTS


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_apply_keeps_names_installs_dispatchers_and_refuses_a_second_time(one_rank_group):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    model = build(tiny_args(), "dense", gen)
    batch = packed_batch([13, 20], model.args.vocab_size, gen)
    single = model(*batch).lm_loss
    before = {n for n, _ in model.named_parameters()}
    names = expert_parameter_names(model)
    a = model.args
    assert len(names) == 3 * a.n_routed_experts * (a.n_layers + a.n_mtp_layers)
    assert "layers.2.ffn.experts.3.w2.weight" in names and "mtp.0.ffn.experts.0.w1.weight" in names
    assert not any("shared_experts" in n or ".gate." in n for n in names)
    apply_expert_parallel(model, one_rank_group, 1, 0)
    assert {n for n, _ in model.named_parameters()} == before
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == a.n_layers + a.n_mtp_layers
    assert all(isinstance(m.dispatcher, ExpertParallelDispatch) for m in moes)
    assert abs(model(*batch).lm_loss.item() - single.item()) < 1e-12  # all-to-all over one rank
    model.layers[1].ffn.experts.pop("0")
    with pytest.raises(ValueError, match=r"already applied.*Fix: apply it once"):
        apply_expert_parallel(model, one_rank_group, 1, 0)
    with pytest.raises(ValueError, match=r"EP group has 1 ranks.*ep=2"):
        apply_expert_parallel(V4Model(tiny_args(), "dense"), one_rank_group, 2, 0)


class _RecordingDispatcher:
    """An EP dispatcher of 2 ranks that records which path ``MoE.forward`` took and runs the rows locally."""

    ep, ep_rank = 2, 0

    def __init__(self) -> None:
        self.calls: list[str] = []

    def dispatch(self, x_sorted, counts):
        self.calls.append("dispatch")
        return x_sorted, counts, None

    def combine(self, y_local, ctx):
        self.calls.append("combine")
        return y_local

    def fp8_experts(self, x_sorted, counts, w13, w2, limit):
        self.calls.append("fp8_experts")
        assert w13.shape == (4, 2 * 32, 32) and w2.shape == (4, 32, 32) and counts.shape == (4,)
        return x_sorted.new_zeros(x_sorted.shape[0], w2.shape[1]) + (w13.sum() + w2.sum()) * 0


@pytest.mark.parametrize("fp8_experts, fp8_dispatch, grouped, expect", [
    (True, True, True, ["fp8_experts"]), (True, False, True, ["dispatch", "combine"]),
    (False, True, True, ["dispatch", "combine"]), (True, True, False, ["dispatch", "combine"])])
def test_moe_sends_e4m3_rows_only_with_fp8_experts_and_fp8_dispatch(fp8_experts, fp8_dispatch, grouped, expect,
                                                                   monkeypatch):
    """``MoE.forward`` takes ``ExpertParallelDispatch.fp8_experts`` (e4m3 rows on the wire) exactly when its experts run
    FP8, ``precision.fp8_dispatch`` is on and the grouped path applies (bf16 compute on SM90+: stubbed here);
    otherwise the dispatch / combine (where an fp32 or float64 forward runs the per-expert loop, as before)."""
    from v4launch.model import moe as moe_module

    monkeypatch.setattr(moe_module, "grouped_mm_applies", lambda x, dim, inter: grouped)
    moe = MoE(1, tiny_args(moe_inter_dim=32))  # FP8 widths: multiples of 16
    moe.dispatcher = _RecordingDispatcher()
    moe.fp8_experts, moe.fp8_dispatch = fp8_experts, fp8_dispatch
    x = torch.randn(6, 32)
    seg = torch.zeros(6, dtype=torch.long)
    y, _ = moe(x, torch.randint(0, 61, (6,)), seg, 1)
    assert moe.dispatcher.calls == expect and y.shape == (6, 32)
