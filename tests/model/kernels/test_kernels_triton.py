"""Triton kernels vs the reference, on an SM90 GPU (skipped cleanly without CUDA / Triton).

Fresh random inputs every run; outputs land in memory poisoned with NaN first, so an
element the kernel never writes shows up as non-finite.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from v4launch.model.kernels import reference as ref  # noqa: E402
from v4launch.model.kernels import triton_attention as ta  # noqa: E402
from v4launch.model.kernels import triton_attention_bwd as tb  # noqa: E402
from v4launch.model.kernels import triton_attention_query_blocks as tqb  # noqa: E402
from v4launch.model.kernels import triton_indexer as ti  # noqa: E402

DEV = "cuda"


def _poison() -> None:
    """Fill the allocator's free blocks with NaN so torch.empty outputs start poisoned."""
    free = torch.cuda.mem_get_info()[0]
    blob = torch.full((min(free // 8, 2 ** 30),), float("nan"), device=DEV)
    del blob


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _problem(T=300, H=64, D=512, N=2500, K=96, dtype=torch.bfloat16, seed=None):
    g = torch.Generator(device=DEV).manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
    q = torch.randn(T, H, D, device=DEV, generator=g).to(dtype)
    kv = torch.randn(N, D, device=DEV, generator=g).to(dtype)
    sink = torch.randn(H, device=DEV, generator=g)
    idx = torch.stack([torch.randperm(N - 200, device=DEV, generator=g)[:K] + 200 for _ in range(T)]).int()
    idx[torch.rand(T, K, device=DEV, generator=g) < 0.2] = -1
    idx[3] = -1
    t = torch.arange(T, device=DEV)
    lo = (t % 150).clamp_max(199)
    ranges = torch.stack((lo, (lo + t % 37).clamp_max(200), t * 0, t * 0), 1).int()
    ranges[5] = 0  # query 5: no window either (with idx[5] possibly masked partly)
    return q, kv, sink, idx, ranges


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("mode", ["idx+ranges", "idx", "ranges"])
def test_sparse_attention_matches_reference(dtype, tol, mode):
    q, kv, sink, idx, ranges = _problem(dtype=dtype)
    idx = idx if "idx" in mode else None
    ranges = ranges if "ranges" in mode else None
    q.requires_grad_(), kv.requires_grad_(), sink.requires_grad_()
    _poison()
    out, lse = ta.sparse_sink_attention(q, kv, idx, sink, 512 ** -0.5, ranges)
    g = torch.randn_like(out)
    dq, dkv, dsink = torch.autograd.grad((out.float() * g.float()).sum(), (q, kv, sink))
    assert all(bool(torch.isfinite(x).all()) for x in (out, lse, dq, dkv, dsink))
    qd, kd, sd = (x.detach().double().requires_grad_() for x in (q, kv, sink))
    o2, l2 = ref.sparse_sink_attention(qd, kd, idx, sd, 512 ** -0.5, ranges)
    r = torch.autograd.grad((o2 * g.double()).sum(), (qd, kd, sd))
    errs = [_rel(out, o2), _rel(lse, l2), _rel(dq, r[0]), _rel(dkv, r[1]), _rel(dsink, r[2])]
    assert max(errs) <= tol, errs


def _check_backward_against_float64(q, kv, sink, idx, ranges, g, dq, dkv, delta) -> None:
    """dq, dkv, delta of a bf16 backward against float64 autograd of the reference (relative error
    <= 1e-2), and exactly zero dKV on the rows no query selects (idx and ranges may each be None)."""
    qd, kd, sd = (x.detach().double().requires_grad_() for x in (q, kv, sink))
    o2, _ = ref.sparse_sink_attention(qd, kd, idx, sd, 512 ** -0.5, ranges)
    r = torch.autograd.grad((o2 * g.double()).sum(), (qd, kd))
    assert _rel(dq, r[0]) <= 1e-2 and _rel(dkv, r[1]) <= 1e-2
    assert _rel(delta, (g.double() * o2).sum(-1)) <= 1e-2
    touched = torch.zeros(kv.shape[0], dtype=torch.bool, device=DEV)
    if idx is not None:
        touched[idx[idx >= 0].long()] = True
    if ranges is not None:
        for a in (0, 2):
            for lo, hi in ranges[:, a:a + 2].tolist():
                touched[lo:hi] = True
    assert float(dkv[~touched].abs().max()) == 0.0


@pytest.mark.parametrize("H,budget", [(64, None), (64, 50_000), (128, 50_000), (16, None), (32, 20_000)])
@pytest.mark.parametrize("cfg", tb.DKV_CANDIDATES, ids=lambda c: "BN{BN}-NP{NP}-w{num_warps}".format(**c))
def test_two_pass_backward_matches_float64(H, budget, cfg, monkeypatch):
    """The two-pass backward (bf16) against float64 autograd of the reference, for every pass-1
    config the sweep may pick: one chunk, many chunks of queries (a budget of a few queries' dS),
    two head blocks, one small head block (16 / 32 heads); rows no query selects get exactly zero dKV;
    the single-pass kernel agrees."""
    monkeypatch.setitem(tb.CONFIGS, "dkv", cfg)
    q, kv, sink, idx, ranges = _problem(H=H)
    out, lse = ta.attention_fwd(q, kv, idx, sink, 512 ** -0.5, ranges)
    g = torch.randn_like(out)
    assert tb.supported(q)
    if budget is not None:
        assert tb.slot_count(ranges, idx.shape[1], tb.CONFIGS["dkv"]["BN"]) * H * 2 * 4 > budget  # > 4 chunks
    _poison()
    dq, dkv, delta = tb.attention_bwd(q, kv, idx, ranges, out, lse, g, 512 ** -0.5, budget_bytes=budget,
                                      dkv_kernel="triton")
    _check_backward_against_float64(q, kv, sink, idx, ranges, g, dq, dkv, delta)
    dq1, dkv1, _ = ta.attention_bwd_single_pass(q, kv, idx, ranges, out, lse, g, 512 ** -0.5)
    assert _rel(dq, dq1) <= 1e-2 and _rel(dkv, dkv1) <= 1e-2


@pytest.mark.parametrize("H,budget", [(16, None), (16, 200_000), (32, None)])
@pytest.mark.parametrize("kind", ["generic", "hca"])
@pytest.mark.parametrize("dq_form,dq_warps", [("query", 4), ("block", 8)])
def test_query_block_backward_matches_float64(H, budget, kind, dq_form, dq_warps, monkeypatch):
    """The query-block backward (range-only layers) in bf16 at its shipped config against float64 autograd of the
    reference: ``generic`` neighbouring queries with unrelated ranges (the union has gaps), ``hca`` packed
    segments with a 128-row window and their ratio-128 entries (the model's ranges), T not a multiple of the
    block; one chunk and many; pass 2 per query and per block; rows no query reaches get exactly zero dKV; the
    single-pass kernel agrees."""
    monkeypatch.setitem(tqb.CONFIG, "dq_form", dq_form)
    monkeypatch.setitem(tqb.CONFIG, "dq_warps", dq_warps)
    T, D = 301, 512
    q, kv, sink, _, ranges = _problem(T=T, H=H)
    if kind == "hca":
        t = torch.arange(T, device=DEV)
        start = torch.where(t < 170, 0, 170)
        pos = t - start
        first = 2300 + start // 128
        ranges = torch.stack((t - pos.clamp_max(127), t + 1, first, first + (pos + 1) // 128), 1).int()
    bounds = tuple(int((ranges[:, 2 * r + 1] - ranges[:, 2 * r]).clamp_min(0).max()) for r in range(2))
    out, lse = ta.attention_fwd(q, kv, None, sink, D ** -0.5, ranges)
    g = torch.randn_like(out)
    assert tqb.supported(q)
    _poison()
    dq, dkv, delta = tqb.attention_bwd(q, kv, ranges, out, lse, g, D ** -0.5, bounds, budget_bytes=budget)
    _check_backward_against_float64(q, kv, sink, None, ranges, g, dq, dkv, delta)
    dq1, dkv1, _ = ta.attention_bwd_single_pass(q, kv, None, ranges, out, lse, g, D ** -0.5)
    assert _rel(dq, dq1) <= 1e-2 and _rel(dkv, dkv1) <= 1e-2


@pytest.mark.parametrize("columns", ["none", "any", "span"], ids=["ranges", "idx+window", "idx-span+window"])
def test_query_block_dispatch_matches_float64(columns, monkeypatch):
    """With ``QUERY_BLOCK_BACKWARD`` on, ``attention_bwd`` at 16 heads given ``range_bounds``: ranges alone run
    in query blocks; beside index columns (sparse-phase CSA) without a span bound the window runs in query blocks
    and the single pass takes the columns and adds the window's float32 dQ; with a span bound of at most
    ``SPAN_PER_COLUMN`` rows per column the columns run in query blocks too, as a masked span (every query's 96
    columns among 192 rows). Against float64 autograd of the reference."""
    monkeypatch.setattr(ta, "QUERY_BLOCK_BACKWARD", True)
    monkeypatch.setattr(ta, "SPAN_PER_COLUMN", 2)
    T, H, D = 301, 16, 512
    q, kv, sink, idx, _ = _problem(T=T, H=H)
    s = torch.arange(T, device=DEV) % 190  # window rows below 200, where the index columns start (no row in both)
    pos = s % 95  # segments of 95 rows: a window grows along its segment, as in a pack
    ranges = torch.stack((s - pos, s + 1, s * 0, s * 0), 1).int()
    span = 0
    if columns == "span":
        span = 2 * idx.shape[1]
        g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
        idx = torch.stack([torch.randperm(span, device=DEV, generator=g)[:idx.shape[1]] + 200 + t % 7
                           for t in range(T)]).int()
        idx[torch.rand(idx.shape, device=DEV, generator=g) < 0.2] = -1
        idx[3] = -1
    idx = None if columns == "none" else idx
    out, lse = ta.attention_fwd(q, kv, idx, sink, D ** -0.5, ranges)
    g = torch.randn_like(out)
    _poison()
    dq, dkv, delta = ta.attention_bwd(q, kv, idx, ranges, out, lse, g, D ** -0.5, range_bounds=(95, span))
    _check_backward_against_float64(q, kv, sink, idx, ranges, g, dq, dkv, delta)


@pytest.mark.skipif(tb.gluon_pass1_unavailable(torch.zeros(1, 64, 512, device=DEV, dtype=torch.bfloat16)) is not None,
                    reason="the Gluon pass 1 needs an SM90 GPU and a tested Triton release with Gluon")
@pytest.mark.parametrize("mode", ["idx+ranges", "idx", "ranges"])
@pytest.mark.parametrize("H,budget", [(64, None), (64, 50_000), (128, 50_000)])
def test_gluon_pass1_matches_float64(H, budget, mode):
    """The backward with the Gluon pass 1 (whole-line dKV reductions after lane exchanges) against
    float64 autograd of the reference: window ranges and index columns, each alone, one chunk and
    many chunks of queries, two head blocks; rows no query selects get exactly zero dKV; the
    Triton pass 1 gives the same dKV to the float32 rounding of reductions done in another order
    (measured 3e-6 to 1.5e-5; one misplaced row of ~2500 would be ~1e-2)."""
    q, kv, sink, idx, ranges = _problem(H=H)
    idx = idx if "idx" in mode else None
    ranges = ranges if "ranges" in mode else None
    out, lse = ta.attention_fwd(q, kv, idx, sink, 512 ** -0.5, ranges)
    g = torch.randn_like(out)
    _poison()
    dq, dkv, delta = tb.attention_bwd(q, kv, idx, ranges, out, lse, g, 512 ** -0.5, budget_bytes=budget,
                                      dkv_kernel="gluon")
    _check_backward_against_float64(q, kv, sink, idx, ranges, g, dq, dkv, delta)
    dq_t, dkv_t, _ = tb.attention_bwd(q, kv, idx, ranges, out, lse, g, 512 ** -0.5, budget_bytes=budget,
                                      dkv_kernel="triton")
    assert _rel(dkv, dkv_t) <= 1e-4 and _rel(dq, dq_t) <= 1e-2


def test_auto_pass1_is_the_gluon_kernel_where_it_runs(monkeypatch):
    """``dkv_kernel="auto"`` launches the Gluon pass 1 on SM90 for V4's D = 512 and the Triton one
    elsewhere (seen by which kernel is launched); asking for Gluon where it cannot run is an error."""
    launched = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    q, kv, sink, idx, ranges = _problem()
    out, lse = ta.attention_fwd(q, kv, idx, sink, 512 ** -0.5, ranges)
    g = torch.randn_like(out)
    why = tb.gluon_pass1_unavailable(q)
    monkeypatch.setattr(tb, "_dkv_pass", Spy("triton", tb._dkv_pass))
    if why is None:
        from v4launch.model.kernels import gluon_attention_bwd as gb

        monkeypatch.setattr(gb, "_dkv_pass", Spy("gluon", gb._dkv_pass))
    tb.attention_bwd(q, kv, idx, ranges, out, lse, g, 512 ** -0.5)
    assert launched and set(launched) == {"triton" if why else "gluon"}
    q2 = q[..., :256].contiguous()
    assert tb.gluon_pass1_unavailable(q2) is not None
    with pytest.raises(ValueError, match="dkv_kernel=.gluon. needs"):
        tb.attention_bwd(q2, kv[:, :256].contiguous(), idx, ranges, out[..., :256].contiguous(), lse,
                         g[..., :256].contiguous(), 1.0, dkv_kernel="gluon")


@pytest.mark.parametrize("cfg", tb.DQ_CANDIDATES, ids=lambda c: "BNQ{BNQ}-s{num_stages}".format(**c))
def test_two_pass_dq_configs_match_float64(cfg, monkeypatch):
    """Every pass-2 config the sweep may pick walks pass 1's slots correctly (BNQ below, equal
    to and above pass 1's BN where it fits)."""
    monkeypatch.setitem(tb.CONFIGS, "dq", cfg)
    q, kv, sink, idx, ranges = _problem()
    out, lse = ta.attention_fwd(q, kv, idx, sink, 512 ** -0.5, ranges)
    g = torch.randn_like(out)
    dq, _, _ = tb.attention_bwd(q, kv, idx, ranges, out, lse, g, 512 ** -0.5, budget_bytes=50_000)
    qd, kd, sd = (x.detach().double().requires_grad_() for x in (q, kv, sink))
    o2, _ = ref.sparse_sink_attention(qd, kd, idx, sd, 512 ** -0.5, ranges)
    assert _rel(dq, torch.autograd.grad((o2 * g.double()).sum(), qd)[0]) <= 1e-2


def test_two_pass_backward_refuses_float32():
    q, kv, _, idx, ranges = _problem(T=8, dtype=torch.float32)
    assert not tb.supported(q)
    with pytest.raises(ValueError, match="bf16/fp16"):
        tb.attention_bwd(q, kv, idx, ranges, q, torch.zeros(8, 64, device=DEV), q, 1.0)


def test_teacher_matches_reference():
    """Both teacher forms: two passes over the gathered rows, and one pass given the attention forward's
    log-sum-exp over the selection (computed with the window ranges and the sink present, which it excludes)."""
    q, kv, sink, idx, ranges = _problem(dtype=torch.bfloat16)
    _poison()
    p = ta.head_avg_probs(q, kv, idx, 512 ** -0.5)
    p2 = ref.head_avg_probs(q.double(), kv.double(), idx, 512 ** -0.5)
    assert bool(torch.isfinite(p).all()) and _rel(p, p2) <= 1e-2
    _, _, selected_lse = ta.sparse_sink_attention_with_selected_lse(q, kv, idx, sink, 512 ** -0.5, ranges)
    p1 = ta.head_avg_probs(q, kv, idx, 512 ** -0.5, selected_lse)
    assert bool(torch.isfinite(p1).all()) and _rel(p1, p2) <= 1e-2 and _rel(p1, p) <= 1e-5
    assert float(p[3].abs().sum()) == 0.0


def test_dense_teacher_at_flash_width_matches_float64():
    """The warm-up teacher over per-row ranges (``triton_dense_teacher``) at Flash width (64 heads x 512), rows of
    a causal compress-ratio-4 segment whose counts cross the 64-entry tiles, one row with no entry: against the
    softmax written out in float64 on the same bf16 inputs (1e-3 relative), every slot past a row's count 0,
    and equal to the sparse teacher over the same selection as a table (same bf16 products: 1e-4)."""
    from v4launch.model.kernels import triton_dense_teacher as td

    T, H, D, n_kv, scale = 200, 64, 512, 300, 512 ** -0.5
    g0 = int(torch.randint(0, 4000, (1,)))
    nvis = ((torch.arange(g0, g0 + T, device=DEV) + 1) // 4).int()
    nvis[7] = 0
    W = int(nvis.max())
    q = torch.randn(T, H, D, device=DEV).to(torch.bfloat16)
    kv = torch.randn(n_kv + W + 5, D, device=DEV).to(torch.bfloat16)
    lo = torch.full((T,), n_kv, dtype=torch.int32, device=DEV) + torch.randint(0, 5, (T,), device=DEV).int()
    _poison()
    p = td.dense_head_avg_probs(q, kv, lo, nvis, W, scale)
    truth = torch.zeros(T, W, dtype=torch.float64, device=DEV)
    for t in range(T):
        n = int(nvis[t])
        if n:
            logits = torch.einsum("hd,cd->hc", q[t].double(), kv[int(lo[t]):int(lo[t]) + n].double()) * scale
            truth[t, :n] = logits.softmax(-1).mean(0)
    assert bool(torch.isfinite(p).all()) and _rel(p, truth) <= 1e-3
    past = torch.arange(W, device=DEV)[None, :] >= nvis[:, None]
    assert float(p[past].abs().sum()) == 0.0
    assert _rel(p, ta.head_avg_probs(q, kv, ref.range_selection(lo, nvis, W), scale)) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_scores_and_topk(dtype):
    T, HI, DI = 1500, 64, 128
    lengths = [900, 400, 200]
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).to(DEV)
    cu = torch.tensor([0, 900, 1300, 1500], device=DEV)
    pos = torch.arange(T, device=DEV) - cu[seg]
    counts = torch.tensor(lengths, device=DEV) // 4
    seg_off = torch.cumsum(counts, 0) - counts
    first, nvis = seg_off[seg], (pos + 1) // 4
    C = int(counts.sum())
    q = torch.randn(T, HI, DI, device=DEV).to(dtype)
    w = torch.randn(T, HI, device=DEV)
    keys = torch.randn(C, DI, device=DEV).to(dtype)
    _poison()
    s = ti.indexer_scores(q, w, keys, first, nvis, 0, C)
    s2 = ref.indexer_scores(q.double(), w.double(), keys.double(), first, nvis, 0, C)
    fin = torch.isfinite(s2)
    assert torch.equal(torch.isfinite(s), fin)
    assert _rel(s[fin], s2[fin]) <= (1e-5 if dtype == torch.float32 else 1e-2)
    k1 = ti.indexer_topk(q, w, keys, first, nvis, 64, 900 // 4)
    k2 = ref.indexer_topk(q.double(), w.double(), keys.double(), first, nvis, 64, 900 // 4)
    same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(k1.cpu(), k2.cpu())]
    assert sum(same) >= 0.99 * T, sum(same)


@pytest.mark.parametrize("HI", [16, 64])
def test_student_scores_match_reference_in_float32_math(HI):
    """The Triton student (gathered keys, float32 logits, atomic key gradient) against the reference's
    chunked float32 path on the same bf16 inputs: the same math, so only the summation order differs."""
    from v4launch.model.kernels import triton_student as ts

    T, DI, C, K = 3000, 128, 1500, 512
    q = torch.randn(T, HI, DI, device=DEV).to(torch.bfloat16)
    w = torch.randn(T, HI, device=DEV)
    keys = torch.randn(C, DI, device=DEV).to(torch.bfloat16)
    sel = torch.stack([torch.randperm(C, device=DEV)[:K] for _ in range(T)]).int()
    sel[torch.rand(T, K, device=DEV) < 0.1] = -1
    g_out = torch.randn(T, K, device=DEV)
    outs = []
    for fn in (ts.student_scores, ref.student_scores):
        args = [x.clone().requires_grad_() for x in (q, w, keys)]
        _poison()
        out = fn(*args, sel)
        outs.append((out, *torch.autograd.grad((out * g_out).sum(), args)))
    ok = sel >= 0
    (s, dq, dw, dk), (s2, dq2, dw2, dk2) = outs
    assert bool(torch.isfinite(s).all()) and _rel(s[ok], s2[ok]) <= 1e-5
    assert _rel(dw, dw2) <= 1e-5 and _rel(dq.float(), dq2.float()) <= 1e-2 and _rel(dk.float(), dk2.float()) <= 1e-2
    assert ts.supported(q, keys)
    torch.use_deterministic_algorithms(True)  # the job's run.deterministic: the kernel still runs, and runs clean
    try:
        assert ts.supported(q, keys)
        args = [x.clone().requires_grad_() for x in (q, w, keys)]
        out = ts.student_scores(*args, sel)
        grads = torch.autograd.grad((out * g_out).sum(), args)
        # same kernels: the scores agree exactly; the key gradient's atomics add in another order, so a few of its
        # bf16 elements round to the neighbouring value (one ulp, 2^-8 relative): rounding, not a different result
        assert _rel(out[ok], s[ok]) <= 1e-6 and _rel(grads[2].float(), dk.float()) <= 1e-3
        assert _rel(grads[2].float(), dk2.float()) <= 1e-2
    finally:
        torch.use_deterministic_algorithms(False)


def _dense_kl_float64(iq, iw, keys, q, comp, first, nvis, scale):
    """The warm-up KL written out in float64, every row at once: teacher = per-head softmax of ``q . comp`` over
    each row's visible entries, averaged over heads; student = ``sum_h w relu(iq . keys)``; KL(teacher || softmax
    of the student over the same entries) summed over rows with an entry. (sum, rows counted)."""
    C = comp.shape[0]
    c = torch.arange(C, device=q.device)
    vis = (c[None, :] >= first[:, None]) & (c[None, :] < (first + nvis)[:, None])  # [T, C]
    t_logits = torch.einsum("thd,cd->thc", q.double(), comp.double()) * scale
    p_t = t_logits.masked_fill(~vis[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0).mean(1)
    s = torch.einsum("thc,th->tc", torch.einsum("thd,cd->thc", iq, keys).relu(), iw)
    log_p_s = s.masked_fill(~vis, float("-inf")).log_softmax(-1)
    has = vis.any(1)
    kl = torch.where(vis, torch.special.xlogy(p_t, p_t) - p_t * log_p_s.masked_fill(~vis, 0.0), 0.0)
    return kl[has].sum(), int(has.sum())


def test_fused_warmup_kl_at_flash_width_matches_float64():
    """The warm-up (dense) KL through the Triton teacher and student (``layer._DenseKL``: every visible entry as the
    selection, row chunks) at V4-Flash's widths (64 heads x 512, indexer 64 x 128) on two packed segments, against
    :func:`_dense_kl_float64` on the same bf16 inputs: the KL and its gradients in the indexer's q, w and keys.
    The KL (a sum of non-negative row KLs) to 1e-3 relative, the gradients to 1e-2 (bf16 storage of dq, d keys)."""
    from v4launch.model.kernels import layer
    from v4launch.model.kernels.dispatch import select_backend

    lengths, H, D, HI, DI, scale = [1536, 512], 64, 512, 64, 128, 512 ** -0.5
    T = sum(lengths)
    seg = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths)).to(DEV)
    pos = torch.arange(T, device=DEV) - torch.tensor([0, lengths[0]], device=DEV)[seg]
    counts = torch.tensor(lengths, device=DEV) // 4
    first, nvis = (torch.cumsum(counts, 0) - counts)[seg], (pos + 1) // 4
    C, n_kv = int(counts.sum()), 700
    q = torch.randn(T, H, D, device=DEV).to(torch.bfloat16)
    kv_all = torch.randn(n_kv + C, D, device=DEV).to(torch.bfloat16)
    iq = torch.randn(T, HI, DI, device=DEV).to(torch.bfloat16)
    iw = torch.randn(T, HI, device=DEV) * (HI * DI) ** -0.5
    keys = torch.randn(C, DI, device=DEV).to(torch.bfloat16)
    g = torch.rand((), device=DEV) + 0.5
    backend = select_backend("triton", DEV)
    assert backend.dense_kl_fused(q, kv_all, iq, keys)  # float32 would fall back to gathering teachers: not fused
    assert not backend.dense_kl_fused(q.float(), kv_all.float(), iq.float(), keys.float())
    chunks = layer.warmup_chunks(first, nvis, 700)  # three chunks, the second across the segment boundary
    leaves = [x.clone().requires_grad_() for x in (iq, iw, keys)]
    _poison()
    kl, rows = layer._DenseKL.apply(*leaves, q, kv_all, first, nvis, chunks, backend, n_kv, scale, True)
    grads = torch.autograd.grad(kl * g, leaves)
    ref_leaves = [x.double().requires_grad_() for x in (iq, iw, keys)]
    kl2, rows2 = _dense_kl_float64(*ref_leaves, q, kv_all[n_kv:], first, nvis, scale)
    grads2 = torch.autograd.grad(kl2 * g.double(), ref_leaves)
    assert int(rows) == rows2 == T - 3 - 3  # rows 0-2 of each segment see no entry
    assert abs(float(kl.detach()) - float(kl2.detach())) <= 1e-3 * float(kl2.detach()) and float(kl2.detach()) > 0
    for got, want, name in zip(grads, grads2, ("dq", "dw", "dkeys")):
        assert bool(torch.isfinite(got).all()) and _rel(got, want) <= 1e-2, (name, _rel(got, want))


def test_student_backward_split_products_keep_float32_math():
    """The bf16 backward's hi + lo products against the same kernel's float32 (``ieee``) products on one input:
    dq and d keys are stored in bf16, so they may differ only where float32 math itself sits at a bf16 rounding
    boundary (a small share of elements, one ulp each). Rounding the float32 gradient ``gl`` to bf16 instead
    (2^-9 relative per term) would move a large share of them by an ulp (2^-8): the 1e-3 bound is between the
    two. Small ``g`` (1e-3), as the KL gradient's ``p_s - p_t``."""
    from v4launch.model.kernels import triton_student as ts

    T, HI, DI, C, K = 2048, 16, 128, 1024, 512
    q = torch.randn(T, HI, DI, device=DEV).to(torch.bfloat16)
    w = torch.randn(T, HI, device=DEV)
    keys = torch.randn(C, DI, device=DEV).to(torch.bfloat16)
    sel = torch.stack([torch.randperm(C, device=DEV)[:K] for _ in range(T)]).int()
    sel[torch.rand(T, K, device=DEV) < 0.1] = -1
    g = torch.randn(T, K, device=DEV) * 1e-3
    split = ts.student_scores_backward(q, w, keys, sel, g, split=True)
    ieee = ts.student_scores_backward(q, w, keys, sel, g, split=False)
    assert _rel(split[1], ieee[1]) <= 1e-6  # dw does not go through the split products
    assert _rel(split[0].float(), ieee[0].float()) <= 1e-3 and _rel(split[2].float(), ieee[2].float()) <= 1e-3
    dq_float32 = torch.einsum("thk,tkd->thd", ((q.float() @ keys.float()[sel.clamp_min(0).long()].transpose(1, 2)) > 0)
                              * w[:, :, None] * (g * (sel >= 0))[:, None, :], keys.float()[sel.clamp_min(0).long()])
    assert _rel(split[0].float(), dq_float32) <= 1e-2  # and both are the gradient: independent float32 formula
    with pytest.raises(ValueError, match="split=True needs bf16"):
        ts.student_scores_backward(q.float(), w, keys.float(), sel, g, split=True)


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
def test_head_cross_entropy_on_the_triton_row_passes_matches_float64(hidden_dtype):
    """The chunked head cross entropy with the Triton row passes (one pass over each float32 logits
    chunk) against float64 ``F.cross_entropy`` on the same operands: value, d hidden, d weight. The
    vocab (50,000) is 12 blocks and a partial one; three chunks, ignored rows in each."""
    import torch.nn.functional as F

    from v4launch.model.kernels import select_backend
    from v4launch.model.loss import head_cross_entropy

    T, d, V = 700, 256, 50_000
    hidden = torch.randn(T, d, device=DEV).to(hidden_dtype)
    weight = (torch.randn(V, d, device=DEV) * 0.3).to(hidden_dtype)
    labels = torch.randint(0, V, (T,), device=DEV)
    labels[torch.rand(T, device=DEV) < 0.1] = -100
    hd, wd = (x.double().requires_grad_() for x in (hidden, weight))
    truth = F.cross_entropy(hd @ wd.t(), labels, ignore_index=-100, reduction="sum")
    grads_t = torch.autograd.grad(truth, (hd, wd))
    backend = select_backend("triton", DEV)
    h, w = (x.clone().requires_grad_() for x in (hidden, weight))
    _poison()
    loss = head_cross_entropy(h, w, labels, chunk_rows=256, kernels=backend)
    grads = torch.autograd.grad(loss, (h, w))
    assert abs(float(loss) - float(truth)) <= 1e-5 * abs(float(truth))
    tol = 1e-2 if hidden_dtype == torch.bfloat16 else 1e-4  # bf16: the gradient GEMMs' operands are bf16
    for name, a, b in zip(("hidden", "weight"), grads, grads_t):
        assert bool(torch.isfinite(a).all()) and _rel(a, b) <= tol, (name, _rel(a, b))


def _sinkhorn_truth(logits, g_out, iters, eps):
    """Float64 Sinkhorn (the rounds written out in PyTorch: the kernel is off with the fused mixing off)
    and its gradient for the output gradient ``g_out``."""
    from v4launch.model import mhc

    ld = logits.double().requires_grad_()
    mhc.set_fused_mixing(False)
    try:
        want = mhc.sinkhorn(ld, iters, eps)
    finally:
        mhc.set_fused_mixing(True)
    (d_want,) = torch.autograd.grad((want * g_out.double()).sum(), ld)
    return want, d_want


def test_sinkhorn_kernel_matches_float64():
    """The mHC Sinkhorn kernels (values and d logits) against the rounds in float64. 8,193 tokens: the
    last program holds one token."""
    from v4launch.model import mhc
    from v4launch.model.kernels import triton_sinkhorn as tsk

    T, hc, iters, eps = 8193, 4, 20, 1e-6
    logits = torch.randn(T, hc, hc, device=DEV) * 4
    g_out = torch.randn(T, hc, hc, device=DEV)
    want, d_want = _sinkhorn_truth(logits, g_out, iters, eps)
    assert tsk.applies(logits)
    lk = logits.clone().requires_grad_()
    _poison()
    got = mhc.sinkhorn(lk, iters, eps)
    (d_got,) = torch.autograd.grad((got * g_out).sum(), lk)
    assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(d_got).all())
    assert _rel(got, want) <= 1e-5 and _rel(d_got, d_want) <= 1e-4, (_rel(got, want), _rel(d_got, d_want))


def test_sinkhorn_kernel_inside_the_compiled_mhc_region_with_dynamic_row_counts():
    """The mHC pre-mixing region compiled as the model compiles it (``regions.compile_rows_dynamic``: fullgraph, so
    the ``triton_op`` must trace without a graph break; the rows dynamic, so one graph serves every row
    count) at two row counts: its Sinkhorn output and the logits' gradient against float64."""
    from v4launch.model import mhc, regions

    torch._dynamo.reset()
    region = regions.compile_rows_dynamic(mhc.hc_pre_tail, mhc.ROW_ARGS["pre"])
    hc, dim, iters, eps = 4, 64, 20, 1e-6
    for T in (8193, 1000):
        logits = torch.randn(T, hc, hc, device=DEV) * 4
        g_out = torch.randn(T, hc, hc, device=DEV)
        want, d_want = _sinkhorn_truth(logits, g_out, iters, eps)
        x = torch.randn(T, hc, dim, device=DEV, dtype=torch.bfloat16)
        scale, base = torch.ones(3, device=DEV), torch.zeros((2 + hc) * hc, device=DEV)
        rs = torch.rsqrt(x.float().square().mean(dim=(1, 2)) + 1e-6)[:, None]  # the region's RMS factor
        raw = torch.zeros(T, (2 + hc) * hc, device=DEV)
        raw[:, 2 * hc:] = logits.flatten(1) / rs  # so that the region's Sinkhorn logits are ``logits``
        raw.requires_grad_()
        _poison()
        _, _, got = region(x, raw, scale, base, iters, eps, 1e-6)
        (d_raw,) = torch.autograd.grad((got * g_out).sum(), raw)
        d_got = (d_raw / rs)[:, 2 * hc:].view(T, hc, hc)
        assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(d_got).all()), T
        assert _rel(got, want) <= 1e-5 and _rel(d_got, d_want) <= 1e-4, (T, _rel(got, want), _rel(d_got, d_want))
