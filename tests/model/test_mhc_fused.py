"""The fusable mHC formulations (compiled on CUDA) against the eager code, in float64 on the CPU."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import LargestTensor
from v4launch.model import mhc, regions


def _inputs(gen, T=7, hc=4, dim=16, dtype=torch.float64):
    n_mix = (2 + hc) * hc
    x = torch.randn(T, hc, dim, generator=gen, dtype=dtype).requires_grad_()
    fn = (0.3 * torch.randn(n_mix, hc * dim, generator=gen, dtype=dtype)).requires_grad_()
    scale = (1 + 0.1 * torch.randn(3, generator=gen, dtype=dtype)).requires_grad_()
    base = (0.5 * torch.randn(n_mix, generator=gen, dtype=dtype)).requires_grad_()
    return x, fn, scale, base


def _grads(outs, leaves, gen):
    seeds = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    return torch.autograd.grad(outs, leaves, seeds)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_fused_pre_and_post_match_the_eager_mixing(gen, backend):
    """hc_pre_tail / hc_post_fused equal hc_pre / hc_post (values and gradients); with ``aot_eager``
    they are also traced whole (fullgraph) with autograd, as torch.compile does on CUDA."""
    x, fn, scale, base = _inputs(gen)
    f = torch.randn(x.shape[0], x.shape[2], generator=gen, dtype=x.dtype, requires_grad=True)
    iters, hc_eps, norm_eps = 20, 1e-6, 1e-6
    y, post, comb = mhc.hc_pre(x, fn, scale, base, iters, hc_eps, norm_eps)
    out = mhc.hc_post(f, x, post, comb)
    pre_tail, post_fused = mhc.hc_pre_tail, mhc.hc_post_fused
    if backend:
        torch._dynamo.reset()
        pre_tail = torch.compile(pre_tail, backend=backend, fullgraph=True)
        post_fused = torch.compile(post_fused, backend=backend, fullgraph=True)
    y2, post2, comb2 = pre_tail(x, x.flatten(1) @ fn.t(), scale, base, iters, hc_eps, norm_eps)
    out2 = post_fused(f, x, post2, comb2)
    for a, b in ((y, y2), (post, post2), (comb, comb2), (out, out2)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    leaves = (x, fn, scale, base, f)
    state = gen.get_state()
    g_eager = _grads((y, out), leaves, gen)
    gen.set_state(state)
    g_fused = _grads((y2, out2), leaves, gen)
    for a, b in zip(g_eager, g_fused):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_switch_and_device_gate():
    cpu = torch.zeros(2, 2, 3)
    assert not mhc._fused_here(cpu)  # eager on the CPU whatever the switch says
    mhc.set_fused_mixing(False)
    try:
        assert not mhc._FUSED["on"]
    finally:
        mhc.set_fused_mixing(True)
    assert mhc._FUSED["on"]


@pytest.mark.parametrize("which", ["pre", "post"])
def test_compiled_mixing_is_one_graph_dynamic_in_the_rows_alone(gen, which):
    """Compiled as the job compiles them (``regions.compile_rows_dynamic``), rows 5..40 share one graph (no
    recompile per batch shape), and in it only the token dimension is symbolic: hc, dim and the mix width stay numbers, so
    inductor unrolls the sums over the hc streams (all dimensions dynamic made them looped reductions with
    symbolic indexing, ~15x slower at Flash width on the H200). Values equal the eager mixing."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    torch._dynamo.reset()
    fn = mhc.hc_pre_tail if which == "pre" else mhc.hc_post_fused
    region = regions.compile_rows_dynamic(fn, mhc.ROW_ARGS[which], backend=capture)
    for T in (5, 9, 17, 40, 23):
        x, fn_w, scale, base = _inputs(gen, T=T)
        f = torch.randn(T, x.shape[2], generator=gen, dtype=x.dtype)
        _, post, comb = mhc.hc_pre(x, fn_w, scale, base, 20, 1e-6, 1e-6)
        if which == "pre":
            got, want = region(x, x.flatten(1) @ fn_w.t(), scale, base, 20, 1e-6, 1e-6), mhc.hc_pre(
                x, fn_w, scale, base, 20, 1e-6, 1e-6)
        else:
            got, want = (region(f, x, post, comb),), (mhc.hc_post(f, x, post, comb),)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 5 row counts"
    tensors = [v for v in graphs[0] if isinstance(v, torch.Tensor)]
    with_symbolic_rows = [v for v in tensors if v.dim() and isinstance(v.shape[0], torch.SymInt)]
    assert len(with_symbolic_rows) == len(mhc.ROW_ARGS[which]), [tuple(v.shape) for v in tensors]
    for v in tensors:
        assert not any(isinstance(d, torch.SymInt) for d in v.shape[1:]), \
            f"{which}: an input of shape {tuple(v.shape)} has symbolic dimensions past the rows"


def test_post_mixing_run_eagerly_keeps_no_four_dimensional_product(gen):
    """hc_post_fused outside a compiled region (dynamo gave up on a call) takes the batched product: no op
    makes a [T, hc, hc, dim] tensor (4 x the streams: 32 MiB per call at 8K rows of a 64-wide tiny model)."""
    T, hc, dim = 33, 4, 16
    x, fn, scale, base = _inputs(gen, T=T, hc=hc, dim=dim)
    f = torch.randn(T, dim, generator=gen, dtype=x.dtype)
    _, post, comb = mhc.hc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    with LargestTensor() as sizes:
        out = mhc.hc_post_fused(f, x, post, comb)
    assert sizes.largest == T * hc * dim  # the result's size; the broadcast would make T * hc * hc * dim
    torch.testing.assert_close(out, mhc.hc_post(f, x, post, comb), rtol=1e-12, atol=1e-12)
