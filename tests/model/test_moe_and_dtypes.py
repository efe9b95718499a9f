"""Balance-loss magnitude (seed 004 item 7a), router bias update, SwiGLU clamp, FP32 pinning;
routed experts: grouped GEMM vs per-expert loop vs plain matmuls, zero-row experts, gradient topology."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import build, packed_batch, randomize, tiny_args
from v4launch.model import V4Model
from v4launch.model.moe import Expert, MoE, run_local_experts, sequence_balance_loss
from v4launch.model.parallel import ExpertDispatch

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


def _plain_swiglu(x, w1, w3, w2, limit):
    """Independent per-expert reference in float64: w2 (silu(min(w1 x, L)) * clamp(w3 x, -L, L))."""
    x, w1, w3, w2 = (t.double() for t in (x, w1, w3, w2))
    gate, up = (x @ w1.T).clamp(max=limit), (x @ w3.T).clamp(-limit, limit)
    return (gate * torch.sigmoid(gate) * up) @ w2.T


def _experts(n, dim, inter, gen, dtype):
    experts = [Expert(dim, inter, swiglu_limit=1.5).to(dtype) for _ in range(n)]
    for e in experts:
        randomize(e, gen, std=0.5)
    return experts


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_local_experts_match_plain_matmuls_with_an_empty_expert(path, gen):
    """float32 on the CPU: outputs and gradients of each path vs per-expert float64 matmuls.
    Expert 1 gets no rows: its weight gradients exist and are exactly zero, every other's are not.
    (The FP8 path: tests/model/test_fp8_experts.py.)"""
    dim, inter = 16, 32  # 16-byte aligned float32 rows, as torch._grouped_mm needs
    experts = _experts(4, dim, inter, gen, torch.float32)
    counts = torch.randint(1, 40, (4,), generator=gen)
    counts[1] = 0
    x = torch.randn(int(counts.sum()), dim, generator=gen).requires_grad_()
    dy = torch.randn(int(counts.sum()), dim, generator=gen)
    y = run_local_experts(experts, x, counts, grouped=path != "loop")
    (y * dy).sum().backward()
    start = 0
    for e, (expert, n) in enumerate(zip(experts, counts.tolist())):
        rows = slice(start, start + n)
        start += n
        w = [getattr(expert, k).weight.detach().double().requires_grad_() for k in ("w1", "w3", "w2")]
        xr = x.detach()[rows].double().requires_grad_()
        ref = _plain_swiglu(xr, *w, 1.5)
        (ref * dy[rows].double()).sum().backward()
        assert torch.allclose(y[rows].double(), ref, rtol=1e-4, atol=1e-5), e
        assert torch.allclose(x.grad[rows].double(), xr.grad, rtol=1e-4, atol=1e-5), e
        for k, wr in zip(("w1", "w3", "w2"), w):
            g = getattr(expert, k).weight.grad
            assert g is not None and torch.allclose(g.double(), wr.grad, rtol=1e-4, atol=1e-5), (e, k)
            assert bool((g == 0).all()) == (n == 0), (e, k)


def test_grouped_and_loop_paths_agree(gen):
    experts = _experts(3, 8, 16, gen, torch.float32)
    counts = torch.tensor([0, 6, 3])
    x = torch.randn(9, 8, generator=gen)
    grouped, loop = (run_local_experts(experts, x, counts, grouped=g) for g in (True, False))
    assert torch.allclose(grouped, loop, rtol=1e-5, atol=1e-6)
    assert run_local_experts(experts, x[:0], torch.zeros(3, dtype=torch.long), grouped=True).shape == (0, 8)


@pytest.mark.parametrize("fp8", [False, True])
def test_experts_that_get_no_rows_at_all_still_get_zero_gradients(fp8, gen):
    """An expert-parallel rank no token chose: zero rows in, zero rows out, and every expert's weights still get a
    gradient tensor (exactly zero), as the optimizer and the gradient reductions expect."""
    experts = _experts(3, 16, 32, gen, torch.float32)
    x = torch.randn(0, 16, generator=gen, requires_grad=True)
    y = run_local_experts(experts, x, torch.zeros(3, dtype=torch.long), grouped=True, fp8=fp8)
    assert y.shape == (0, 16)
    y.sum().backward()
    grads = [getattr(e, k).weight.grad for e in experts for k in ("w1", "w2", "w3")]
    assert all(g is not None and not bool(g.any()) for g in grads) and x.grad.shape == (0, 16)


def test_moe_equals_dense_per_token_sum_and_zero_row_experts_get_zero_grads(gen):
    """float64 MoE vs y_t = shared(x_t) + sum_k w_tk expert_{i_tk}(x_t) written token by token.
    Expert 0 is never chosen (bias -1e3): its grads are exactly zero, and it is still counted (0)."""
    args = tiny_args()
    moe = MoE(1, args).double()
    randomize(moe, gen)
    moe.gate.bias.zero_()
    moe.gate.bias[0] = -1e3
    T = 11
    x = torch.randn(T, args.dim, generator=gen, dtype=torch.float64).requires_grad_()
    seg = torch.zeros(T, dtype=torch.long)
    y, _ = moe(x, torch.zeros(T, dtype=torch.long), seg, 1)
    weights, indices, _ = moe.gate(x.detach(), None)
    for t in range(T):
        ref = moe.shared_experts(x[t:t + 1].detach())[0]
        for k in range(args.n_activated_experts):
            ref = ref + weights[t, k] * moe.experts[str(int(indices[t, k]))](x[t:t + 1].detach())[0]
        assert torch.allclose(y[t], ref, rtol=1e-12, atol=1e-12), t
    (y * torch.randn(y.shape, generator=gen, dtype=torch.float64)).sum().backward()
    counts = moe.expert_counts.tolist()
    assert counts[0] == 0 and sum(counts) == T * args.n_activated_experts
    for e, n in enumerate(counts):
        grad = moe.experts[str(e)].w1.weight.grad
        assert grad is not None and bool((grad == 0).all()) == (n == 0), (e, n)


def test_routed_experts_keep_released_names_in_a_module_dict_keyed_by_global_id():
    moe = MoE(1, tiny_args())
    assert list(moe.experts.keys()) == [str(e) for e in range(moe.n_experts)]
    assert "experts.3.w2.weight" in dict(moe.named_parameters())


def test_rows_reach_the_dispatcher_sorted_by_expert_in_the_compute_dtype(gen):
    """Under autocast the rows travel in bf16 (half the all-to-all bytes); counts cover all T*K slots."""
    args = tiny_args()
    moe = MoE(1, args)
    randomize(moe, gen)
    seen = []

    class Recording(ExpertDispatch):
        def dispatch(self, x_sorted, counts):
            seen.append((x_sorted.dtype, counts.tolist()))
            return super().dispatch(x_sorted, counts)

    moe.dispatcher = Recording()
    T, zeros = 7, torch.zeros(7, dtype=torch.long)
    x = torch.randn(T, args.dim, generator=gen)
    moe(x, zeros, zeros, 1)
    with torch.autocast("cpu", torch.bfloat16):
        y, _ = moe(x, zeros, zeros, 1)
    assert [d for d, _ in seen] == [torch.float32, torch.bfloat16] and y.dtype == torch.float32
    assert all(sum(c) == T * args.n_activated_experts and len(c) == args.n_routed_experts for _, c in seen)


def test_indexer_queries_and_keys_share_the_compute_dtype_under_autocast(gen, monkeypatch):
    """Under bf16 autocast a float32 model's indexer hands the student / top-k kernels q and keys in one dtype
    (bf16): float32 keys from the compressor (its input the float32 embedding) promoted q to float32 and
    sent the Triton student to float32 math on the CUDA cores (~25x slower at Flash width). The keys' gradient
    still reaches the indexer's compressor through the cast, and only the indexer's parameters. A CSA first layer:
    its input is the float32 embedding (later layers get the blocks' bf16 output)."""
    from v4launch.model.indexer import Indexer

    model = build(tiny_args(compress_ratios=(4, 128, 4, 0, 0), n_hash_layers=0), "sparse", gen, dtype=torch.float32)
    seen = []
    prepare = Indexer.prepare

    def recording(self, *a, **k):
        inp = prepare(self, *a, **k)
        seen.append((inp.q.dtype, inp.keys.dtype, inp.w.dtype))
        return inp

    monkeypatch.setattr(Indexer, "prepare", recording)
    tokens, cu, max_len, labels = packed_batch([40, 24], model.args.vocab_size, gen)
    with torch.autocast("cpu", torch.bfloat16):
        out = model(tokens, cu, max_len, labels)
    n_csa = sum(1 for r in model.args.compress_ratios[:model.args.n_layers] if r == 4)
    assert len(seen) == n_csa and all(s == (torch.bfloat16, torch.bfloat16, torch.float32) for s in seen), seen
    kl = [v for k, v in out.aux_losses.items() if k.startswith("indexer_kl/")]
    assert len(kl) == n_csa
    sum(kl).backward()
    for name, p in model.named_parameters():
        reached = p.grad is not None and bool(p.grad.abs().sum() > 0)
        if ".indexer.compressor." in name and name.endswith(("wkv.weight", "wgate.weight")):
            assert reached, name
        elif ".indexer." not in name:
            assert not reached, name
