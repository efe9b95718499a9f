"""Runs the Triton kernels under Triton's CPU interpreter against float64 references; prints one
JSON object {case: {quantity: relative L2 error}}.

Started by test_kernels_interpreter.py in a subprocess, because ``TRITON_INTERPRET=1`` must be
set before the kernels are defined (at import). Usage: ``python interpreter_cases.py SEED``.
The shapes are small (the interpreter runs every program on numpy) but walk every path the
kernels have: window ranges and index columns alone and together, masked slots, queries with no
candidate, several query chunks of the two-pass backward, two head blocks.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from v4launch.model.kernels import reference as ref  # noqa: E402
from v4launch.model.kernels import triton_attention as ta  # noqa: E402
from v4launch.model.kernels import triton_attention_bwd as tb  # noqa: E402
from v4launch.model.kernels import triton_attention_query_blocks as tqb  # noqa: E402
from v4launch.model.kernels import triton_cross_entropy as tce  # noqa: E402
from v4launch.model.kernels import triton_dense_teacher as td  # noqa: E402
from v4launch.model.kernels import triton_indexer as ti  # noqa: E402
from v4launch.model.kernels import triton_sinkhorn as tsk  # noqa: E402
from v4launch.model.kernels import triton_student as ts  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def problem(g: torch.Generator, T: int, H: int, D: int, N: int, K: int, mode: str):
    """q [T, H, D], kv [N, D], sink [H] float32; idx [T, K] (20% masked, query 3 all masked) and
    two ranges per query (query 5 none), each present only if ``mode`` names it."""
    q = torch.randn(T, H, D, generator=g)
    kv = torch.randn(N, D, generator=g)
    sink = torch.randn(H, generator=g)
    idx = torch.stack([torch.randperm(N - 50, generator=g)[:K] + 50 for _ in range(T)]).int()
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    idx[3] = -1
    t = torch.arange(T)
    lo = (t % 30).clamp_max(49)
    ranges = torch.stack((lo, (lo + t % 23).clamp_max(50), 0 * t + 100, 100 + t % 5), 1).int()
    ranges[5] = 0
    return q, kv, sink, (idx if "idx" in mode else None), (ranges if "ranges" in mode else None)


def float64_truth(q, kv, sink, idx, ranges, g_out, scale):
    qd, kd, sd = (x.double().requires_grad_() for x in (q, kv, sink))
    out, lse = ref.sparse_sink_attention(qd, kd, idx, sd, scale, ranges)
    grads = torch.autograd.grad((out * g_out.double()).sum(), (qd, kd, sd))
    return out.detach(), lse.detach(), grads


def attention_cases(seed: int) -> dict:
    """Forward kernel + single-pass backward (float32 autograd path) and the two-pass backward."""
    res = {}
    for mode in ("idx+ranges", "idx", "ranges"):
        g = torch.Generator().manual_seed(seed)
        q, kv, sink, idx, ranges = problem(g, T=24, H=16, D=32, N=120, K=20, mode=mode)
        scale = 32 ** -0.5
        g_out = torch.randn(q.shape, generator=g)
        out_t, lse_t, (dq_t, dkv_t, dsink_t) = float64_truth(q, kv, sink, idx, ranges, g_out, scale)
        qk, kvk, sk = (x.clone().requires_grad_() for x in (q, kv, sink))
        out, lse = ta.sparse_sink_attention(qk, kvk, idx, sk, scale, ranges)
        dq, dkv, dsink = torch.autograd.grad((out * g_out).sum(), (qk, kvk, sk))
        res[f"single_pass/{mode}"] = dict(out=rel(out, out_t), lse=rel(lse, lse_t), dq=rel(dq, dq_t),
                                          dkv=rel(dkv, dkv_t), dsink=rel(dsink, dsink_t))
        if idx is not None:  # the forward's log-sum-exp over the selection alone (the KL teacher's normaliser)
            _, _, sel_lse = ta.sparse_sink_attention_with_selected_lse(q, kv, idx, sink, scale, ranges)
            ok = idx >= 0
            logits = torch.einsum("thd,tkd->thk", q.double(), kv.double()[idx.long().clamp_min(0)]) * scale
            truth = logits.masked_fill(~ok[:, None, :], float("-inf")).logsumexp(-1)
            rows = ok.any(1)
            res[f"single_pass/{mode}"]["selected_lse"] = rel(sel_lse[rows], truth[rows])
            res[f"single_pass/{mode}"]["selected_lse_empty_rows"] = float((sel_lse[~rows] > -1e29).sum())

        # Two-pass backward: the bf16-only gate exists for the GPU's shared memory, which the
        # interpreter does not have, so float32 runs it here; H = 128 is two head blocks of 64, H = 16 one
        # block of 16 (the small-head form); the budget of a few queries' dS makes many query chunks.
        for H, name in ((128, "two_pass"), (16, "two_pass_h16")):
            g = torch.Generator().manual_seed(seed + 1)
            q, kv, sink, idx, ranges = problem(g, T=24, H=H, D=64, N=120, K=20, mode=mode)
            scale = 64 ** -0.5
            g_out = torch.randn(q.shape, generator=g)
            out_t, lse_t, (dq_t, dkv_t, _) = float64_truth(q, kv, sink, idx, ranges, g_out, scale)
            saved = tb.supported, dict(tb.CONFIGS)
            tb.supported = lambda q: True  # noqa: E731
            tb.CONFIGS.update(dkv=dict(BN=32, NP=4, num_warps=4, num_stages=1),
                              dq=dict(BNQ=16, num_warps=4, num_stages=1))
            try:
                dq, dkv, delta = tb.attention_bwd(q, kv, idx, ranges, out_t.float(), lse_t.float(), g_out, scale,
                                                  budget_bytes=100_000 * H // 128)
            finally:
                tb.supported, _ = saved
                tb.CONFIGS.update(saved[1])
            res[f"{name}/{mode}"] = dict(dq=rel(dq, dq_t), dkv=rel(dkv, dkv_t),
                                         delta=rel(delta, (g_out.double() * out_t).sum(-1)))
    return res


def window_like_ranges(g: torch.Generator, T: int, window: int, first_entry: int, ratio: int):
    """[T, 4] ranges as the model builds them for a pack of random-length segments: each query's window (the
    last ``window`` rows of its own segment, itself included) and its segment's visible compressed entries
    (one per ``ratio`` tokens; segment s's entries start at kv row ``first_entry`` + the earlier segments'
    entry counts)."""
    lengths, left = [], T
    while left:
        lengths.append(min(left, int(torch.randint(1, 12, (1,), generator=g))))
        left -= lengths[-1]
    rows, entry = [], first_entry
    for n in lengths:
        start = sum(len(r) for r in rows) if rows else 0
        seg = []
        for pos in range(n):
            t = start + pos
            seg.append((t - min(pos, window - 1), t + 1, entry, entry + (pos + 1) // ratio))
        rows.append(seg)
        entry += n // ratio
    return torch.tensor([r for seg in rows for r in seg], dtype=torch.int32)


def query_block_cases(seed: int) -> dict:
    """The query-block backward (range-only layers, 16 and 32 heads: blocks of 4 and 2 queries; pass 2 per query
    and per block) against float64:
    the generic ranges of :func:`problem` (neighbouring queries with unrelated ranges, an empty one, a union
    with gaps) and window-like ranges (what the model builds), a partial last block, several query chunks."""
    res = {}
    for H, kind, dq_form in ((16, "generic", "query"), (16, "window", "block"), (32, "generic", "block"),
                             (32, "window", "query")):
        g = torch.Generator().manual_seed(seed + 7 + H)
        T, D, N = 23, 64, 120
        q, kv, sink, _, ranges = problem(g, T=T, H=H, D=D, N=N, K=20, mode="ranges")
        if kind == "window":
            ranges = window_like_ranges(g, T, window=5, first_entry=100, ratio=2)
        bounds = tuple(int((ranges[:, 2 * r + 1] - ranges[:, 2 * r]).clamp_min(0).max()) for r in range(2))
        scale = D ** -0.5
        g_out = torch.randn(q.shape, generator=g)
        out_t, lse_t, (dq_t, dkv_t, _) = float64_truth(q, kv, sink, None, ranges, g_out, scale)
        saved = tqb.supported, dict(tqb.CONFIG)
        tqb.supported = lambda q: True  # noqa: E731  (the interpreter runs float32)
        tqb.CONFIG.update(BN=16, BNQ=16, dq_form=dq_form)
        try:
            budget = 8 * H * sum(triton.cdiv(max(b, 1), 16) * 16 for b in bounds) * 4  # 8 queries' dS
            dq, dkv, delta = tqb.attention_bwd(q, kv, ranges, out_t.float(), lse_t.float(), g_out, scale,
                                               bounds, budget_bytes=budget)
        finally:
            tqb.supported, _ = saved
            tqb.CONFIG.update(saved[1])
        res[f"query_blocks_h{H}/{kind}"] = dict(dq=rel(dq, dq_t), dkv=rel(dkv, dkv_t),
                                                delta=rel(delta, (g_out.double() * out_t).sum(-1)))
    try:  # a bound shorter than a range (host ranges are checked): refused, not written into the next slots
        tqb.attention_bwd(q.bfloat16(), kv.bfloat16(), ranges, out_t.bfloat16(), lse_t.float(), g_out, scale,
                          (bounds[0] - 1, bounds[1]))
        refused = 0.0
    except ValueError as e:
        refused = 1.0 if "ranges are up to" in str(e) else 0.0
    res["query_blocks_h32/window"]["short_bound_accepted"] = 1.0 - refused
    res.update(query_block_span_cases(seed))
    res["query_blocks_dispatch"] = query_block_dispatch(seed)
    return res


def narrow_columns(g: torch.Generator, T: int, K: int, lo: int, width: int) -> torch.Tensor:
    """[T, K] int32 index columns, each query's K distinct rows drawn from [lo, lo + width) (a span of at most
    ``width`` rows, as sparse-phase CSA picks its top-k among a segment's visible entries); 20% masked, query 3
    none, query 6 a single column."""
    idx = torch.stack([torch.randperm(width, generator=g)[:K] + lo for _ in range(T)]).int()
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    idx[3] = -1
    idx[6, 1:] = -1
    return idx


def query_block_span_cases(seed: int) -> dict:
    """Index columns run in query blocks as a masked span (``index_span`` + ``selected``) against float64 of the
    columns themselves: 16 and 32 heads, both pass-2 forms, several query chunks, a window beside the columns;
    ``too_long_span_accepted`` 1 = a span bound shorter than a query's span was not refused."""
    res = {}
    for H, dq_form in ((16, "query"), (32, "block")):
        g = torch.Generator().manual_seed(seed + 11 + H)
        T, D, K, width = 21, 64, 12, 30
        q, kv, sink = torch.randn(T, H, D, generator=g), torch.randn(120, D, generator=g), torch.randn(H, generator=g)
        idx = narrow_columns(g, T, K, lo=70, width=width)
        ranges = window_like_ranges(g, T, window=5, first_entry=100, ratio=2).index_fill_(1, torch.tensor([2, 3]), 0)
        scale = D ** -0.5
        g_out = torch.randn(q.shape, generator=g)
        out_t, lse_t, (dq_t, dkv_t, _) = float64_truth(q, kv, sink, idx, ranges, g_out, scale)
        spans, selected = tqb.index_span(idx, ranges, width)
        saved = tqb.supported, dict(tqb.CONFIG)
        tqb.supported = lambda q: True  # noqa: E731  (the interpreter runs float32)
        tqb.CONFIG.update(BN=16, BNQ=16, dq_form=dq_form)
        try:
            budget = 8 * H * (16 + 32) * 4  # 8 queries' dS: several chunks
            dq, dkv, _ = tqb.attention_bwd(q, kv, spans, out_t.float(), lse_t.float(), g_out, scale, (5, width),
                                           budget_bytes=budget, selected=selected)
        finally:
            tqb.supported, _ = saved
            tqb.CONFIG.update(saved[1])
        res[f"query_blocks_span_h{H}"] = dict(dq=rel(dq, dq_t), dkv=rel(dkv, dkv_t))
    try:
        tqb.index_span(idx, ranges, int((spans[:, 3] - spans[:, 2]).max()) - 1)
        refused = 0.0
    except ValueError as e:
        refused = 1.0 if "span" in str(e) else 0.0
    res["query_blocks_span_h32"]["too_long_span_accepted"] = 1.0 - refused
    return res


def query_block_dispatch(seed: int) -> dict:
    """Through the operator (``sparse_sink_attention`` with ``range_bounds``) and autograd, with
    ``QUERY_BLOCK_BACKWARD`` on, against float64: ranges alone (the query-block kernels take the whole layer),
    ranges beside index columns without a span bound (they take the ranges, the single pass the columns and adds
    their dQ) and with one (they take the columns too, as a masked span: ``SPAN_PER_COLUMN``);
    ``not_run`` 1 = the query-block kernels did not run once per backward; ``masked_span_wrong`` 1 = they took
    the columns as a masked span where they should not have, or not where they should."""
    g = torch.Generator().manual_seed(seed + 9)
    q, kv, sink, idx, _ = problem(g, T=10, H=16, D=64, N=120, K=20, mode="idx")
    ranges = window_like_ranges(g, 10, window=4, first_entry=100, ratio=2)
    g_out = torch.randn(q.shape, generator=g)
    runs, res = [], {}
    saved = tqb.supported, tqb.attention_bwd, ta.QUERY_BLOCK_BACKWARD, ta.SPAN_PER_COLUMN
    tqb.supported = lambda q: True  # noqa: E731  (float32 in the interpreter)
    ta.SPAN_PER_COLUMN = 2
    tqb.attention_bwd = lambda *a, **k: (runs.append(k.get("selected") is not None), saved[1](*a, **k))[1]  # noqa: E731
    ta.QUERY_BLOCK_BACKWARD = True
    try:
        window_only = ranges.clone().index_fill_(1, torch.tensor([2, 3]), 0)
        narrow = narrow_columns(g, 10, 20, lo=60, width=30)  # span <= 30 <= SPAN_PER_COLUMN * 20 columns
        for name, columns, rng, bounds in (("ranges", None, ranges, (4, 5)), ("ranges+idx", idx, window_only, (4, 0)),
                                           ("ranges+idx span", narrow, window_only, (4, 30))):
            _, _, (dq_t, dkv_t, dsink_t) = float64_truth(q, kv, sink, columns, rng, g_out, 64 ** -0.5)
            qk, kvk, sk = (x.clone().requires_grad_() for x in (q, kv, sink))
            before = len(runs)
            out, _ = ta.sparse_sink_attention(qk, kvk, columns, sk, 64 ** -0.5, rng, bounds)
            dq, dkv, dsink = torch.autograd.grad((out * g_out).sum(), (qk, kvk, sk))
            res.update({f"{name} dq": rel(dq, dq_t), f"{name} dkv": rel(dkv, dkv_t),
                        f"{name} dsink": rel(dsink, dsink_t), f"{name} not_run": float(len(runs) - before != 1),
                        f"{name} masked_span_wrong": float(runs[before:] != [name.endswith("span")])})
    finally:
        tqb.supported, tqb.attention_bwd, ta.QUERY_BLOCK_BACKWARD, ta.SPAN_PER_COLUMN = saved
    return res


def teacher_and_indexer_cases(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 2)
    q, kv, _, idx, _ = problem(g, T=24, H=16, D=32, N=120, K=20, mode="idx")
    p = ta.head_avg_probs(q, kv, idx, 32 ** -0.5)
    p_t = ref.head_avg_probs(q.double(), kv.double(), idx, 32 ** -0.5)
    _, _, sel_lse = ta.sparse_sink_attention_with_selected_lse(q, kv, idx, torch.zeros(16), 32 ** -0.5)
    p_one_pass = ta.head_avg_probs(q, kv, idx, 32 ** -0.5, sel_lse)  # the normaliser from the attention forward
    R, HI, DI, C = 40, 8, 32, 70
    qi, w, keys = torch.randn(R, HI, DI, generator=g), torch.randn(R, HI, generator=g), torch.randn(C, DI, generator=g)
    first = torch.randint(0, 20, (R,), generator=g)
    n_vis = torch.randint(0, 40, (R,), generator=g)
    s = ti.indexer_scores(qi, w, keys, first, n_vis, 10, 60)
    s_t = ref.indexer_scores(qi.double(), w.double(), keys.double(), first, n_vis, 10, 60)
    same_inf = bool(torch.equal(torch.isinf(s), torch.isinf(s_t)))
    fin = torch.isfinite(s_t)
    return {"teacher": dict(probs=rel(p, p_t), probs_given_selected_lse=rel(p_one_pass, p_t)),
            "indexer_scores": dict(scores=rel(s[fin], s_t[fin]), masked_differ=0.0 if same_inf else 1.0)}


def dense_teacher_case(seed: int) -> dict:
    """The warm-up teacher over per-row ranges against float64 softmax written here: rows with no visible entry
    (all slots 0), one seeing the full width, the rest random; 16-entry tiles so pass 1 and pass 2 cross tiles
    and the zero tail starts mid-width; both forms of pass 2 (entries or heads as the M dimension)."""
    g = torch.Generator().manual_seed(seed + 7)
    T, H, D, N, W = 20, 16, 32, 150, 45
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(N, D, generator=g)
    n_vis = torch.randint(1, W + 1, (T,), generator=g)
    n_vis[0], n_vis[1] = 0, W
    lo = torch.randint(0, N - W, (T,), generator=g)
    truth = torch.zeros(T, W, dtype=torch.float64)
    for t in range(T):
        n = int(n_vis[t])
        if n:
            logits = torch.einsum("hd,cd->hc", q[t].double(), kv[lo[t]:lo[t] + n].double()) * D ** -0.5
            truth[t, :n] = logits.softmax(-1).mean(0)
    res = {}
    saved = dict(td.CONFIG)
    try:
        for transposed in (True, False):
            td.CONFIG.update(BN=16, BT=16, TRANSPOSED=transposed)
            p = td.dense_head_avg_probs(q, kv, lo, n_vis, W, D ** -0.5)
            past = torch.arange(W)[None, :] >= n_vis[:, None]
            res[f"probs_{'entries' if transposed else 'heads'}_as_m"] = rel(p, truth)
            res[f"past_visible_nonzero_{'entries' if transposed else 'heads'}_as_m"] = float(p[past].abs().sum())
    finally:
        td.CONFIG.clear()
        td.CONFIG.update(saved)
    return {"dense_teacher": res}


def student_case(seed: int, HI: int = 16) -> dict:
    """The sparse-phase KL student and its three gradients against a dense float64 formula (every
    entry scored, then read at the selection). K = 70 is two blocks and a partial one; each row
    selects distinct entries, rows share entries (the key gradient's atomics collide), 20% of the
    slots are masked and row 2 entirely. HI = 32: two head blocks of ``triton_student.HB``, whose
    key gradients add up in one program and whose dq / dw come from two programs."""
    g = torch.Generator().manual_seed(seed + 3 + HI)
    T, DI, C, K = 12, 32, 90, 70
    q, w, keys = torch.randn(T, HI, DI, generator=g), torch.randn(T, HI, generator=g), torch.randn(C, DI, generator=g)
    sel = torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(T)]).int()
    sel[torch.rand(T, K, generator=g) < 0.2] = -1
    sel[2] = -1
    g_out = torch.randn(T, K, generator=g)
    qd, wd, kd = (x.double().requires_grad_() for x in (q, w, keys))
    dense = torch.einsum("thc,th->tc", torch.einsum("thd,cd->thc", qd, kd).relu(), wd)  # [T, C]
    truth = dense.gather(1, sel.clamp_min(0).long())
    ok = (sel >= 0).double()
    grads_t = torch.autograd.grad((truth * g_out.double() * ok).sum(), (qd, wd, kd))
    qk, wk, kk = (x.clone().requires_grad_() for x in (q, w, keys))
    out = ts.student_scores(qk, wk, kk, sel)
    grads = torch.autograd.grad((out * g_out).sum(), (qk, wk, kk))
    return {f"student{'' if HI == 16 else f'_h{HI}'}": dict(scores=rel(out[sel >= 0], truth[sel >= 0]),
                            **{f"d{n}": rel(a, b) for n, a, b in zip(("q", "w", "keys"), grads, grads_t)})}


def cross_entropy_case(seed: int) -> dict:
    """The head cross entropy's row passes against float64 ``log_softmax``: V = 9,000 is two vocab
    blocks and a partial one; logits scaled by 30 so the running maximum moves between blocks (row 0's
    largest logit is in the last block); rows 1 and 4 ignored (-100)."""
    g = torch.Generator().manual_seed(seed + 4)
    R, V = 6, 9000
    z = torch.randn(R, V, generator=g) * 30
    z[0, -5] = 400.0
    labels = torch.randint(0, V, (R,), generator=g)
    labels[1] = labels[4] = -100
    scale = torch.randn(R, generator=g) * (labels != -100)
    zd = z.double()
    logp = torch.log_softmax(zd, -1)
    ok = labels != -100
    loss_t = torch.where(ok, -logp.gather(1, labels.clamp_min(0)[:, None]).squeeze(1), 0.0)
    dz_t = scale.double()[:, None] * (logp.exp() - torch.nn.functional.one_hot(labels.clamp_min(0), V) * ok[:, None])
    lse, loss = tce.logsumexp_target(z, labels)
    dz = tce.softmax_grad(z, lse, labels, scale, torch.float32)
    return {"cross_entropy": dict(lse=rel(lse, torch.logsumexp(zd, -1)), loss=rel(loss, loss_t), dz=rel(dz, dz_t),
                                  ignored_rows=float(dz[~ok].abs().max() + loss[~ok].abs().max()))}


def sinkhorn_case(seed: int) -> dict:
    """The mHC Sinkhorn kernels against the rounds written out in float64 here (row softmax + eps, a
    column normalisation, then row / column rounds, each denominator + eps): hc 2, 4 and 8, one, two
    and twenty rounds, a token count that leaves the last program part-filled, logits large enough
    (x 4) for the rounds to matter. (Traced by ``torch.compile``: test_kernels_triton.py, on a GPU.)"""
    g = torch.Generator().manual_seed(seed + 5)

    def truth(logits, iters, eps):
        c = logits.softmax(-1) + eps
        c = c / (c.sum(-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(-1, keepdim=True) + eps)
            c = c / (c.sum(-2, keepdim=True) + eps)
        return c

    errors = {}
    for hc, iters, n in ((4, 20, 45), (4, 1, 7), (2, 2, 33), (8, 20, 5)):
        logits = torch.randn(n, hc, hc, generator=g) * 4
        g_out = torch.randn(n, hc, hc, generator=g)
        ld = logits.double().requires_grad_()
        want = truth(ld, iters, 1e-6)
        (d_want,) = torch.autograd.grad((want * g_out.double()).sum(), ld)
        lk = logits.clone().requires_grad_()
        got = tsk.sinkhorn(lk, iters, 1e-6)
        (d_got,) = torch.autograd.grad((got * g_out).sum(), lk)
        errors[f"hc{hc}_it{iters}"] = rel(got, want)
        errors[f"hc{hc}_it{iters}_dlogits"] = rel(d_got, d_want)
    return {"sinkhorn": errors}


def opcheck_case(seed: int) -> dict:
    """``torch.library.opcheck`` on every kernel operator (schema, fake shape function against the real
    output, autograd registration, tracing by AOTAutograd with dynamic shapes), on small CPU inputs run
    by the interpreter: 0 = passed; a failure is keyed by its message."""
    g = torch.Generator().manual_seed(seed + 6)
    T, H, D, N, K = 5, 16, 32, 40, 6
    q = torch.randn(T, H, D, generator=g).requires_grad_()
    kv = torch.randn(N, D, generator=g).requires_grad_()
    sink = torch.randn(H, generator=g).requires_grad_()
    idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32)
    idx[1, 2:] = -1
    t = torch.arange(T)
    ranges = torch.stack((t, t + 3, t * 0, t * 0), 1).int()
    out, lse, sel_lse = ta.sparse_sink_attention_with_selected_lse(q, kv, idx, sink, 0.2, ranges)
    dout = torch.randn(T, H, D, generator=g)
    HI, DI, C = 16, 16, 12
    iq = torch.randn(T, HI, DI, generator=g).requires_grad_()
    iw = torch.randn(T, HI, generator=g).requires_grad_()
    keys = torch.randn(C, DI, generator=g).requires_grad_()
    sel = torch.randint(-1, C, (T, 4), generator=g, dtype=torch.int32)
    first = torch.zeros(T, dtype=torch.int64)
    n_visible = torch.tensor([0, 3, 7, 12, 12])
    cases = {
        "sparse_sink_attention": (torch.ops.v4launch.sparse_sink_attention.default, (q, kv, sink, idx, ranges, 0.2)),
        "sparse_sink_attention_backward": (torch.ops.v4launch.sparse_sink_attention_backward.default,
                                           (q.detach(), kv.detach(), sink.detach(), idx, ranges, out.detach(),
                                            lse, dout, 0.2)),
        "sparse_sink_attention with range_bounds": (torch.ops.v4launch.sparse_sink_attention.default,
                                                    (q, kv, sink, None, ranges, 0.2, [3, 0])),
        "head_avg_probs": (torch.ops.v4launch.head_avg_probs.default, (q.detach(), kv.detach(), idx, 0.2)),
        "head_avg_probs given selected_lse": (torch.ops.v4launch.head_avg_probs.default,
                                              (q.detach(), kv.detach(), idx, 0.2, sel_lse.detach())),
        "dense_head_avg_probs": (torch.ops.v4launch.dense_head_avg_probs.default,
                                 (q.detach(), kv.detach(), first[:T] + 2, n_visible, 12, 0.2)),
        "indexer_topk": (torch.ops.v4launch.indexer_topk.default,
                         (iq.detach(), iw.detach(), keys.detach(), first, n_visible, 4, 12)),
        "student_scores": (torch.ops.v4launch.student_scores.default, (iq, iw, keys, sel)),
        "student_scores_backward": (torch.ops.v4launch.student_scores_backward.default,
                                    (iq.detach(), iw.detach(), keys.detach(), sel, torch.randn(T, 4, generator=g))),
    }
    results = {}
    for name, (op, args) in cases.items():
        try:
            torch.library.opcheck(op, args)
            results[name] = 0.0
        except Exception as e:  # noqa: BLE001 - every failure is reported by name, with its message
            results[f"{name}: {type(e).__name__}: {str(e)[:300]}"] = 1.0
    return {"opcheck": results}


if __name__ == "__main__":
    seed = int(sys.argv[1])
    print(json.dumps({**attention_cases(seed), **query_block_cases(seed), **teacher_and_indexer_cases(seed),
                      **dense_teacher_case(seed),
                      **student_case(seed), **student_case(seed, HI=32),
                      **cross_entropy_case(seed), **sinkhorn_case(seed), **opcheck_case(seed)}))
