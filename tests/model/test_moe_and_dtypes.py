"""Balance-loss magnitude (seed 004 item 7a), router bias update, SwiGLU clamp, FP32 pinning."""

from __future__ import annotations

import torch

from v4_helpers import build, packed_batch, tiny_args
from v4launch.model import V4Model
from v4launch.model.moe import Expert, sequence_balance_loss

E, K = 8, 2


def test_balance_loss_is_one_when_balanced_and_e_over_k_when_collapsed():
    T = 16
    idx = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1)  # every expert chosen 4 times
    seg = torch.zeros(T, dtype=torch.long)
    uniform = torch.rand(T, 1).expand(T, E).contiguous()  # P_i = 1/E
    assert abs(sequence_balance_loss(uniform, idx, seg, 1, E).item() - 1.0) < 1e-6
    collapsed_scores = torch.zeros(T, E)
    collapsed_scores[:, :K] = torch.rand(1).item() + 0.5
    collapsed_idx = torch.arange(K).expand(T, K)
    loss = sequence_balance_loss(collapsed_scores, collapsed_idx, seg, 1, E)
    assert abs(loss.item() - E / K) < 1e-6


def test_balance_loss_is_per_segment_then_averaged():
    idx_a = torch.arange(K).expand(4, K)  # segment 0 collapsed -> E/K
    idx_b = torch.stack([torch.arange(4) * 2 % E, (torch.arange(4) * 2 + 1) % E], 1)  # segment 1 balanced
    scores = torch.cat([torch.zeros(4, E).index_fill_(1, torch.arange(K), 1.0), torch.ones(4, E)])
    seg = torch.tensor([0] * 4 + [1] * 4)
    loss = sequence_balance_loss(scores, torch.cat([idx_a, idx_b]), seg, 2, E)
    assert abs(loss.item() - (E / K + 1.0) / 2) < 1e-6


def test_update_router_bias_moves_toward_underloaded_experts(gen):
    model = build(tiny_args(), "dense", gen, dtype=torch.float32)
    model.train()
    gate = model.layers[1].ffn.gate
    before = gate.bias.clone()
    model(*packed_batch([50], model.args.vocab_size, gen))
    counts = model.layers[1].ffn.expert_counts.clone().double()
    model.update_router_bias(0.01)
    delta = gate.bias - before
    assert torch.allclose(delta, 0.01 * torch.sign(counts.mean() - counts).float())
    assert model.layers[1].ffn.expert_counts.sum() == 0  # counts reset
    assert not hasattr(model.layers[0].ffn.gate, "bias") or model.layers[0].ffn.gate.is_hash


def test_swiglu_clamp_shared_and_routed():
    ex = Expert(4, 3, swiglu_limit=1.0).double()
    with torch.no_grad():
        ex.w1.weight.fill_(10.0); ex.w3.weight.fill_(-10.0); ex.w2.weight.copy_(torch.eye(4, 3, dtype=torch.float64))
    y = ex(torch.ones(1, 4, dtype=torch.float64))
    expect = torch.nn.functional.silu(torch.tensor(1.0, dtype=torch.float64)) * -1.0
    assert torch.allclose(y[0, :3], expect.expand(3))


def test_fp32_pinned_under_bfloat16_and_float64_everywhere(gen):
    model = build(tiny_args(), "sparse", gen, dtype=torch.float32)
    ref_sink = model.layers[1].attn.attn_sink.detach().clone()
    model = model.to(torch.bfloat16)
    pinned = ("attn_sink", "ape", "hc_", "gate.bias")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        leaf = name.rsplit(".", 1)[-1]
        if not t.is_floating_point():
            continue
        is_pinned = leaf in ("attn_sink", "ape") or leaf.startswith("hc_") or name.endswith("gate.bias")
        assert t.dtype == (torch.float32 if is_pinned else torch.bfloat16), name
    assert torch.equal(model.layers[1].attn.attn_sink, ref_sink)  # kept exactly, not round-tripped
    out = model(*packed_batch([20, 140], model.args.vocab_size, gen))
    assert torch.isfinite(out.lm_loss) and all(torch.isfinite(v) for v in out.aux_losses.values())
    out.lm_loss.backward()
    assert model.layers[1].attn.attn_sink.grad.dtype == torch.float32
    model.double()
    assert all(t.dtype == torch.float64 for t in model.parameters())
    assert assert_sub_cast_pins()


def assert_sub_cast_pins() -> bool:
    """Casting a sub-module on its own keeps its pinned tensors too."""
    model = V4Model(tiny_args(), "dense")
    attn = model.layers[2].attn.bfloat16()
    return attn.attn_sink.dtype == torch.float32 and attn.compressor.ape.dtype == torch.float32
