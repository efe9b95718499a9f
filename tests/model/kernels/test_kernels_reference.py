"""Kernel-path layer forward on the reference backend == Attention.forward (CPU, float64),
and the dispatch contract. Triton parity lives in test_kernels_triton.py (GPU only)."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import fresh_gen, randomize, tiny_args
from v4launch.model.attention import Attention, BatchContext
from v4launch.model.kernels import BACKEND_NAMES, BackendUnavailable, attention_forward, reference, select_backend
from v4launch.model.packing import make_pack


def _layer(layer_id: int, indexer: bool, gen):
    args = tiny_args(index_topk=3)
    attn = Attention(layer_id, args, with_indexer=indexer).double()
    randomize(attn, gen)
    return attn, args


@pytest.mark.parametrize("layer_id,indexer,target", [(0, False, "selected"), (1, False, "selected"),
                                                     (1, True, "selected"), (1, True, "visible"),
                                                     (2, False, "selected")])
def test_layer_matches_reference_module(layer_id, indexer, target):
    gen = fresh_gen()
    attn, args = _layer(layer_id, indexer, gen)
    lengths = [37, 5, 22]
    T = sum(lengths)
    cu = torch.tensor([0, 37, 42, 64])
    pack = make_pack(torch.zeros(T, dtype=torch.long), cu, max(lengths))
    x = torch.randn(T, args.dim, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(T, args.dim, generator=gen, dtype=torch.float64)
    res = []
    for path in ("module", "kernels"):
        ctx = BatchContext(pack, args.window_size, target, chunk_size=7)
        attn.zero_grad()
        x.grad = None
        if path == "module":
            out, kl = attn(x, ctx)
        else:
            out, kl = attention_forward(attn, x, ctx, select_backend("reference", "cpu"))
        loss = (out * g).sum() + (kl if kl is not None else 0.0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
        res.append((out.detach(), None if kl is None else kl.detach(), x.grad.clone(), grads))
    (o1, k1, gx1, g1), (o2, k2, gx2, g2) = res
    torch.testing.assert_close(o2, o1, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(gx2, gx1, rtol=1e-9, atol=1e-10)
    assert (k1 is None) == (k2 is None)
    if k1 is not None:
        torch.testing.assert_close(k2, k1, rtol=1e-9, atol=1e-10)
    assert g1.keys() == g2.keys()
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-8, atol=1e-10, msg=n)


def test_reference_attention_gradcheck():
    gen = fresh_gen()
    T, H, D, N = 5, 2, 4, 9
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(N, D, generator=gen, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(H, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, -1, 3], [1, 2, -1], [-1, -1, -1], [4, 5, 6], [8, 0, 7]], dtype=torch.int32)
    ranges = torch.tensor([[6, 8, 0, 0], [3, 3, 7, 9], [0, 0, 0, 0], [0, 2, 2, 2], [1, 3, 3, 4]], dtype=torch.int32)
    fn = lambda a, b, c: reference.sparse_sink_attention(a, b, idx, c, 0.7, ranges)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, kv, sink))
    out, lse = reference.sparse_sink_attention(q, kv, idx, sink, 0.7, ranges)
    assert torch.allclose(out[2], torch.zeros_like(out[2])) and torch.allclose(lse[2], sink)


def test_reference_student_scores_match_dense_scores_at_the_selection():
    """The chunked student (explicit backward, index_add_ key gradient) against every entry scored
    densely and read at the selection, float64, across two row chunks; masked slots carry no gradient."""
    gen = fresh_gen()
    T, HI, DI, C, K = 7, 3, 5, 11, 4
    q = torch.randn(T, HI, DI, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(T, HI, generator=gen, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(C, DI, generator=gen, dtype=torch.float64, requires_grad=True)
    sel = torch.stack([torch.randperm(C, generator=gen)[:K] for _ in range(T)]).int()
    sel[torch.rand(T, K, generator=gen) < 0.3] = -1
    g_out = torch.randn(T, K, generator=gen, dtype=torch.float64) * (sel >= 0)
    dense = torch.einsum("thc,th->tc", torch.einsum("thd,cd->thc", q, keys).relu(), w)
    truth = dense.gather(1, sel.clamp_min(0).long())
    saved = reference._StudentScores.ROWS
    reference._StudentScores.ROWS = 4  # two chunks
    try:
        out = reference.student_scores(q, w, keys, sel)
        grads = torch.autograd.grad((out * g_out).sum(), (q, w, keys))
    finally:
        reference._StudentScores.ROWS = saved
    grads_t = torch.autograd.grad((truth * g_out).sum(), (q, w, keys))
    assert out.dtype == torch.float64 and torch.allclose(out, truth, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("q", "w", "keys"), grads, grads_t):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name


def test_dispatch_names_and_fallbacks():
    pytest.importorskip("pydantic")
    from v4launch.model.kernels.dispatch import schema_names

    assert tuple(schema_names()) == BACKEND_NAMES
    assert select_backend("reference", "cpu").name == "reference"
    b = select_backend("triton", "cpu")
    assert b.name == "reference" and "not a CUDA GPU" in b.reason
    with pytest.raises(BackendUnavailable, match="FlashMLA"):
        select_backend("cudnn", "cpu")
    with pytest.raises(ValueError, match="kernel_backend"):
        select_backend("flash", "cpu")
