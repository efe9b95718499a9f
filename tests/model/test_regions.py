"""The compiled elementwise regions of an eager CUDA step (model/regions.py: RMSNorm, the unweighted per-head
RMS norm, RoPE, the experts' clamped SwiGLU), checked on the CPU: each region is one graph for every row count with only the rows symbolic,
its values and gradients equal the eager code in float64, and the model's modules route through it where the
regions apply (forced here on the CPU with the ``aot_eager`` backend, which traces without generating code)."""

from __future__ import annotations

import pytest
import torch

from v4launch.model import common, fp8_experts, moe, regions, rope


def _capture(graphs):
    def backend(gm, example_inputs):
        graphs.append([n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward
    return backend


def _only_rows_symbolic(graph, n_row_args):
    tensors = [v for v in graph if isinstance(v, torch.Tensor)]
    rows = [v for v in tensors if v.dim() and isinstance(v.shape[0], torch.SymInt)]
    assert len(rows) == n_row_args, [tuple(v.shape) for v in tensors]
    for v in tensors:
        assert not any(isinstance(d, torch.SymInt) for d in v.shape[1:]), tuple(v.shape)


CASES = {
    "rms_norm": (common.rms_norm, (0,), lambda T, g: (torch.randn(T, 3, 16, generator=g, dtype=torch.float64),
                                                      1 + 0.1 * torch.randn(16, generator=g, dtype=torch.float64),
                                                      1e-6)),
    "rms_unweighted_forward": (common._rms_unweighted_forward, (0,),
                               lambda T, g: (torch.randn(T, 16, generator=g, dtype=torch.float64), 1e-6)),
    "rms_unweighted_backward": (common._rms_unweighted_backward, (0, 1, 2),
                                lambda T, g: (torch.randn(T, 16, generator=g, dtype=torch.float64),
                                              torch.rand(T, 1, generator=g, dtype=torch.float64) + 0.5,
                                              torch.randn(T, 16, generator=g, dtype=torch.float64))),
    "rope": (rope._rotate, (0, 1, 2), lambda T, g: (torch.randn(T, 4, 16, generator=g, dtype=torch.float64),
                                                    torch.randn(T, 4, generator=g, dtype=torch.float64),
                                                    torch.randn(T, 4, generator=g, dtype=torch.float64), True)),
    "weighted_slot_sum": (moe._weighted_slot_sum, (0, 1),
                          lambda T, g: (torch.randn(T, 3, 16, generator=g, dtype=torch.float64),
                                        torch.rand(T, 3, generator=g, dtype=torch.float64))),
    "swiglu": (moe._swiglu, (0, 1), lambda T, g: (torch.randn(T, 16, generator=g, dtype=torch.float64),
                                                  torch.randn(T, 16, generator=g, dtype=torch.float64), 1.5, None)),
    # the FP8 experts' casts (model/fp8_experts.py): rows of x / dy, and stacks of expert weights (rows = experts)
    "rowwise_e4m3": (fp8_experts.rowwise_e4m3, (0,), lambda T, g: (torch.randn(T, 32, generator=g),)),
    "rowwise_e4m3_weight_stack": (fp8_experts.rowwise_e4m3, (0,), lambda T, g: (torch.randn(T, 16, 32, generator=g),)),
    "swiglu_e4m3": (fp8_experts.swiglu_e4m3, (0,), lambda T, g: (torch.randn(T, 32, generator=g), 1.5)),
    "swiglu_grad_e4m3": (fp8_experts.swiglu_grad_e4m3, (0, 1), lambda T, g: (torch.randn(T, 32, generator=g),
                                                                              torch.randn(T, 16, generator=g), 1.5)),
    # the e4m3 rows an FP8 EP exchange received, back in the compute dtype for the weight gradients
    "dequantize_rows": (fp8_experts._dequantize, (0, 1),
                        lambda T, g: (*fp8_experts.rowwise_e4m3(torch.randn(T, 32, generator=g)), torch.bfloat16)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_region_is_one_graph_for_every_row_count_with_only_the_rows_symbolic(gen, name):
    fn, row_args, make = CASES[name]
    graphs = []
    torch._dynamo.reset()
    region = regions.compile_rows_dynamic(fn, row_args, backend=_capture(graphs))
    for T in (5, 9, 17, 40, 23):
        args = make(T, gen)
        got, want = region(*args), fn(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 5 row counts"
    _only_rows_symbolic(graphs[0], len(row_args))


def _plain_rms_norm(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _plain_rope(x, cos, sin, inverse):
    """Interleaved pairs of the last 2 * rd/2 channels rotated by angle (cos, sin), negated when inverse."""
    rd = 2 * cos.shape[-1]
    out = x.clone()
    s = -sin if inverse else sin
    for j in range(rd // 2):
        a, b = x[..., x.shape[-1] - rd + 2 * j], x[..., x.shape[-1] - rd + 2 * j + 1]
        c, sj = cos[:, None, j], s[:, None, j]
        out[..., x.shape[-1] - rd + 2 * j] = a * c - b * sj
        out[..., x.shape[-1] - rd + 2 * j + 1] = a * sj + b * c
    return out


@pytest.fixture
def regions_forced(monkeypatch):
    """The regions on for CPU float64 tensors, traced by aot_eager (forward and backward graphs, run eagerly)."""
    monkeypatch.setattr(regions, "fused_here", lambda t: True)
    monkeypatch.setitem(regions._STATE, "backend", "aot_eager")
    monkeypatch.setitem(regions._STATE, "built", {})
    torch._dynamo.reset()
    yield regions._STATE["built"]
    torch._dynamo.reset()


def test_modules_route_through_the_regions_and_keep_values_and_gradients(gen, regions_forced):
    """RMSNorm, the per-head RMS norm and RoPE through their regions against plain float64 formulas written
    here (values and every gradient), and the regions were the path taken."""
    T, H, D, rd = 11, 4, 16, 8
    norm = common.RMSNorm(D).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64))
    x = torch.randn(T, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(T, rd // 2, generator=gen, dtype=torch.float64)
    sin = torch.randn(T, rd // 2, generator=gen, dtype=torch.float64)
    seeds = [torch.randn(T, H, D, generator=gen, dtype=torch.float64) for _ in range(3)]

    outs = [norm(x), common.rms_unweighted(x, 1e-6), rope.apply_rope(x, cos, sin, inverse=True)]
    got = torch.autograd.grad(sum((o * s).sum() for o, s in zip(outs, seeds)), (x, norm.weight))
    assert set(regions_forced) == {common.rms_norm, common._rms_unweighted_forward,
                                   common._rms_unweighted_backward, rope._rotate}

    xr = x.detach().clone().requires_grad_()
    wr = norm.weight.detach().clone().requires_grad_()
    want_outs = [_plain_rms_norm(xr, wr, norm.eps), _plain_rms_norm(xr, torch.ones_like(wr), 1e-6),
                 _plain_rope(xr, cos, sin, True)]
    want = torch.autograd.grad(sum((o * s).sum() for o, s in zip(want_outs, seeds)), (xr, wr))
    for a, b in zip(outs, want_outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_cpu_and_float64_stay_eager():
    assert not regions.fused_here(torch.zeros(2, 3))
    if torch.cuda.is_available():
        assert not regions.fused_here(torch.zeros(2, 3, device="cuda", dtype=torch.float64))
    regions.set_fused_regions(False)
    try:
        assert not regions._STATE["on"]
    finally:
        regions.set_fused_regions(True)


@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_the_experts_swiglu_routes_through_its_region_and_keeps_values_and_gradients(gen, regions_forced, limit):
    """``Expert.activation`` (the routed experts' grouped path hands its GEMM dtype as ``out_dtype``) against
    ``silu(min(g, L)) * clamp(u, -L, L)`` written here in float64, values and both gradients; L = 0: no clamp.
    Inputs drawn wide (std 2) so the clamps cut."""
    expert = moe.Expert(8, 16, swiglu_limit=limit).double()
    gate = (2 * torch.randn(13, 16, generator=gen, dtype=torch.float64)).requires_grad_()
    up = (2 * torch.randn(13, 16, generator=gen, dtype=torch.float64)).requires_grad_()
    seed = torch.randn(13, 16, generator=gen, dtype=torch.float64)
    out = expert.activation(gate, up, torch.float64)
    got = torch.autograd.grad((out * seed).sum(), (gate, up))
    assert set(regions_forced) == {moe._swiglu}
    g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    gc, uc = (g.clamp(max=limit), u.clamp(-limit, limit)) if limit else (g, u)
    want_out = gc * torch.sigmoid(gc) * uc
    want = torch.autograd.grad((want_out * seed).sum(), (g, u))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert out.dtype == torch.float64 and expert.activation(gate.float(), up.float(), torch.bfloat16).dtype == \
        torch.bfloat16


def test_the_moe_combine_routes_through_its_region_and_keeps_values_and_gradients(gen, regions_forced):
    """``moe.combine_slots`` (expert outputs of the sorted slots back to tokens, weighted) against the sum written
    here slot by slot in float64: values and the gradients of the outputs and the routing weights."""
    T, K, E, D = 9, 3, 5, 8
    indices = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    route = moe.route_slots(indices, E)
    ys = torch.randn(T * K, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, generator=gen, dtype=torch.float64, requires_grad=True)
    seed = torch.randn(T, D, generator=gen, dtype=torch.float64)
    out = moe.combine_slots(ys, route, w)
    got = torch.autograd.grad((out * seed).sum(), (ys, w))
    assert set(regions_forced) == {moe._weighted_slot_sum}
    ys2, w2 = ys.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    sorted_experts = indices.flatten().sort(stable=True)[0]
    rows = []
    for t in range(T):
        acc = torch.zeros(D, dtype=torch.float64)
        for k in range(K):  # the slot of (t, k): the sorted position among slots of the same expert, stably
            e = int(indices[t, k])
            before = int((sorted_experts < e).sum())
            rank = int(sum(1 for s in range(t * K + k) if int(indices.flatten()[s]) == e))
            acc = acc + w2[t, k] * ys2[before + rank]
        rows.append(acc)
    want_out = torch.stack(rows)
    want = torch.autograd.grad((want_out * seed).sum(), (ys2, w2))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
