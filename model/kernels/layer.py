"""Kernel-path forward of one ``model.attention.Attention`` layer (drop-in for ``Attention.forward``).

``attention_forward(attn, x, ctx, backend)`` computes exactly what ``attn(x, ctx)`` computes
(same parameters, same phases, same KL definition) but runs the core through a
:class:`~v4launch.model.kernels.dispatch.Backend`:

* the query / KV / compressor / indexer projections are the module's own code;
* candidates: the sliding window and (HCA, dense-mode CSA) every visible compressed
  entry are passed as per-query row *ranges* into ``kv_all = cat(kv, comp)``; CSA with an
  indexer passes the top-k as an index table [T, k] (``backend.indexer_topk``);
* one ``backend.sparse_sink_attention`` call over all T queries (no query chunking);
* sparse-phase KL: teacher = ``backend.head_avg_probs`` over the selected entries (given the
  attention's per-head log-sum-exp over the selection where the backend returns it: one gather less),
  student = ``backend.student_scores``, the indexer scores at the selection (float32 logits,
  recomputed in backward);
* warm-up KL (teacher over ALL visible entries) is quadratic by definition: on a backend whose teacher and
  student run as kernels (``Backend.dense_kl_fused``) it runs them in row chunks with every visible entry as
  the selection (:class:`_DenseKL`; the teacher reads each query's entries as a range,
  ``Backend.visible_head_avg_probs``), elsewhere the reference math in query chunks with the student
  checkpointed per chunk (:func:`_warmup_kl`).

Context parallelism: the same code on a rank's rows, with the left-boundary rows as extra keys and
the CP-gathered compressed entries (see ``attention_forward``); the kernels need no change.

Memory is O(T * (H * D + k)) apart from the warm-up teacher's per-chunk block.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..common import acc_dtype, forward_is_a_replay, forward_is_replayed_later, linear, on_device_count
from ..indexer import kl_from_teacher_probs, kl_teacher_student
from ..rope import apply_rope
from . import reference
from .dispatch import Backend


def gather_label(cp, layer_id: int) -> str:
    """Name of a layer's entry all-gather for the CP traffic counter ("layer_NN"); "layer" on one
    device (``cp.size == 1``), where nothing is gathered: a per-layer string would make
    ``torch.compile`` specialise, and recompile, every compiled block on its layer id."""
    return f"layer_{layer_id:02d}" if cp.size > 1 else "layer"


def kl_from_probs(p_t: torch.Tensor, student: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of KL(p_t || softmax(student)) over valid slots; rows without a valid slot count 0.
    Same value as ``indexer.kl_teacher_student`` given the teacher's probabilities; the row count is
    a 0-d device tensor (``indexer.kl_from_teacher_probs``: no host synchronisation)."""
    return kl_from_teacher_probs(p_t, student, valid)


def warmup_chunks(first: torch.Tensor, nvis: torch.Tensor, rows_per: int) -> list[tuple[int, int, int, int]]:
    """The warm-up KL's query chunks: (r0, r1, lo, hi) per ``rows_per`` rows, [lo, hi) the global entry ids any
    query of rows r0..r1-1 sees (``first`` [T], ``nvis`` [T] as in :func:`_warmup_kl`), chunks that see no entry
    left out. ONE host read for all chunks (it was two per chunk)."""
    T = first.shape[0]
    if not T:
        return []
    starts = torch.arange(0, T, rows_per, device=first.device)
    end = (first + nvis).long()
    pad = (-T) % rows_per
    ends = torch.cat((end, end.new_full((pad,), torch.iinfo(torch.int64).min))).view(-1, rows_per).amax(1)
    bounds = torch.stack((first[starts].long(), ends)).tolist()
    return [(r0, min(T, r0 + rows_per), lo, max(lo, hi)) for r0, lo, hi in zip(range(0, T, rows_per), *bounds)
            if hi > lo]


def static_chunks(T: int, rows_per: int, width: int) -> list[tuple[int, int, int, int]]:
    """The warm-up KL's query chunks of a static batch (``BatchContext.static``: a step a CUDA graph replays),
    from host ints alone: (r0, r1, 0, width) per ``rows_per`` rows, ``width`` the plan's bound on any query's
    visible entries. Unlike :func:`warmup_chunks` nothing is read from the device (a capture forbids it), so no
    chunk is trimmed to its rows' entries or skipped: the student scores ``width`` slots per row (masked past
    each row's count); the teacher reads each row's own range. With it the job captures warm-up stages too (rule
    V4-CUDA-GRAPH, ``validators/derived.graph_free_reason``): the warm-up cases of
    tests/training/test_cuda_graph_step.py replay equal to the eager step (H100, 2026-12-05)."""
    return [(r0, min(T, r0 + rows_per), 0, width) for r0 in range(0, T, rows_per)] if width else []


@torch.compiler.disable  # host-side chunk bounds: dynamo would break the graph at the read and specialise on them
def _warmup_kl(attn, inp, q: torch.Tensor, comp: torch.Tensor, first: torch.Tensor, nvis: torch.Tensor,
               max_entries: int) -> tuple[Optional[torch.Tensor], torch.Tensor | int]:
    """Warm-up KL: teacher over every visible entry (reference math, chunked; quadratic compute).

    Runs eagerly inside a compiled block (``torch.compiler.disable``): its chunks' entry ranges are host ints
    (one read per call, :func:`warmup_chunks`), on which a traced version broke the graph twice per chunk and
    recompiled for each new value (the compiled warm-up step did not finish compiling in 240 s on an H200);
    its work is a few large einsums per chunk, which gain little from fusion."""
    T, H = q.shape[0], q.shape[1]
    acc = acc_dtype(q.dtype)
    rows_per = max(16, min(T, 2 ** 26 // max(1, H * max_entries)))
    total, count = None, 0
    j = torch.arange(max_entries, device=q.device)
    for r0, r1, lo, hi in warmup_chunks(first, nvis, rows_per):
        vis_valid = j[None, :] < nvis[r0:r1, None]
        vis_rel = (first[r0:r1, None] - lo + j[None, :]) * vis_valid
        with torch.no_grad():
            full = torch.einsum("rhd,cd->rhc", q[r0:r1], comp[lo:hi].to(q.dtype)).to(acc) * attn.softmax_scale
            teacher = full.gather(2, vis_rel[:, None, :].expand(-1, H, -1))
        rows = slice(r0, r1)

        def student_fn(iq, iw, ik, rows=rows, lo=lo, hi=hi, vis_rel=vis_rel):
            logits = torch.einsum("rhd,cd->rhc", iq[rows].to(acc), ik[lo:hi].to(acc))
            return torch.einsum("rhc,rh->rc", logits.relu(), iw[rows].to(acc)).gather(1, vis_rel)

        student = checkpoint(student_fn, inp.q, inp.w, inp.keys, use_reentrant=False)
        part, n = kl_teacher_student(teacher, student, vis_valid)
        total, count = (part if total is None else total + part), count + n
    return total, count


def visible_selection(first: torch.Tensor, nvis: torch.Tensor, r0: int, r1: int, width: int) -> torch.Tensor:
    """Every entry rows r0..r1-1 see, as a selection table [r1 - r0, width] int32 of global entry ids: row r's
    slot j is ``first[r] + j`` for j < ``nvis[r]``, -1 after (``width`` >= the rows' largest ``nvis``)."""
    return reference.range_selection(first[r0:r1], nvis[r0:r1], width)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


class _DenseKL(torch.autograd.Function):
    """The warm-up KL on a kernel backend: the teacher over every visible entry
    (``Backend.visible_head_avg_probs``: each query's entries one contiguous run of ``kv_all`` rows) and the
    sparse phase's student (``student_scores``) with every visible entry as the selection
    (:func:`visible_selection`, the same slot order), row chunk by row chunk. Its gradient (in the indexer's q, w and keys only; the teacher is detached, seed 000 §3) is formed in
    the forward, per chunk, as ``d KL / d student = p_s * sum(p_t) - p_t`` through the student's backward, and
    scaled by the incoming gradient in the backward: memory stays O(rows x indexer width) plus one chunk's
    [rows, entries] tables, where saving each chunk's tables for the backward would hold O(T x entries).

    Under whole-layer recompute the first pass forms the value and the gradient and keeps the gradient on this
    node (``ctx`` attributes: the checkpoint drops saved tensors, not those), and the replay skips the KL
    (``common.forward_is_a_replay``; it saves nothing in either pass): the teacher and the student's forward run
    once per step instead of twice. The replay still returns the right row count, which the layer divides by
    (the division saves it for the backward), and a zero KL sum, which no operation of the layer saves. The cost is the gradient held from the layer's forward to its
    backward, dq [T, HI, dI] in the indexer's dtype, dw [T, HI], d keys [C, dI] float32 (the memory plan's
    ``memory_activations.warmup_kl_gradient_bytes``). Before (the replay formed the gradient, the first pass the
    value alone), a 4-layer, 64K-token warm-up step at Flash width on the H200 ran the teacher and student
    forward twice: 4,500 ms against the sparse step's 2,710 (benchmarks/results/flash_width_h200_2026-12-04.md)."""

    @staticmethod
    def forward(ctx, iq, iw, keys, q, kv_all, first, nvis, chunks, backend, n_kv, scale, need_grad):
        ctx.kept = None
        ctx.keys_dtype = keys.dtype
        total = torch.zeros((), dtype=acc_dtype(iq.dtype), device=q.device)
        count = torch.zeros((), dtype=torch.int64, device=q.device)
        if forward_is_a_replay():  # the first pass kept the gradient on its own node (class docstring)
            for r0, r1, _lo, _hi in chunks:  # kl_from_probs's count: the rows with a visible entry
                count = count + (nvis[r0:r1] > 0).sum()
            ctx.mark_non_differentiable(count)
            return total, count
        dq = dw = dkeys = None  # the gradient, formed only when one is wanted (not under no_grad / evaluation)
        if need_grad:
            dq, dw = torch.zeros_like(iq), torch.zeros_like(iw)
            dkeys = torch.zeros(keys.shape, dtype=acc_dtype(keys.dtype), device=keys.device)  # summed over chunks
        for r0, r1, lo, hi in chunks:
            sel = visible_selection(first, nvis, r0, r1, hi - lo)
            valid = sel >= 0
            p_t = backend.visible_head_avg_probs(q[r0:r1], kv_all, first[r0:r1] + n_kv, nvis[r0:r1], hi - lo,
                                                 scale)  # [R, W], slot j entry first + j as in sel
            # the student's own graph lives inside this chunk: its saved tensors bypass the enclosing hooks (whole-
            # layer recompute's checkpoint would rerun the layer to unpack them here; host offload would copy them)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                leaves = [t.detach().requires_grad_(need_grad) for t in (iq[r0:r1], iw[r0:r1], keys)]
                student = backend.student_scores(*leaves, sel)  # [R, W] float32
            s = student.detach()
            part, n = kl_from_probs(p_t, s, valid)
            total, count = total + part, count + n
            if need_grad:
                has = valid.any(1, keepdim=True)
                scores = torch.where(valid, s, torch.where(has, float("-inf"), 0.0))  # as kl_from_probs
                p_s = torch.where(valid, scores.softmax(-1), 0.0)
                p_t = torch.where(valid, p_t.to(s.dtype), 0.0)
                with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                    g_q, g_w, g_k = torch.autograd.grad(student, leaves, p_s * p_t.sum(1, keepdim=True) - p_t)
                dq[r0:r1], dw[r0:r1] = g_q, g_w
                dkeys += g_k
        if need_grad and forward_is_replayed_later():
            ctx.kept = (dq, dw, dkeys)  # outside the saved tensors: the checkpoint leaves them as they are
        else:
            ctx.save_for_backward(dq, dw, dkeys)
        ctx.mark_non_differentiable(count)
        return total, count

    @staticmethod
    def backward(ctx, g_total, _g_count):
        dq, dw, dkeys = ctx.kept if ctx.kept is not None else ctx.saved_tensors
        return (g_total * dq, g_total * dw, (g_total * dkeys).to(ctx.keys_dtype),
                *([None] * 9))


@torch.compiler.disable  # host-side chunk bounds, as _warmup_kl
def _fused_warmup_kl(attn, inp, q: torch.Tensor, kv_all: torch.Tensor, n_kv: int, first: torch.Tensor,
                     nvis: torch.Tensor, max_entries: int, backend: Backend,
                     static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Warm-up KL (the same value and indexer gradients as :func:`_warmup_kl`) through the backend's teacher and
    student kernels (:class:`_DenseKL`): q [T, H, D] and kv_all [N, D] the main attention's (detached here), the
    compressed entries at kv_all rows ``n_kv + id``. Row chunks of [rows, entries] <= 2^26 slots (4,096 rows at
    16K entries): one host read per call (:func:`warmup_chunks`), or none for a static batch
    (:func:`static_chunks`; ``static``: ``BatchContext.static``, a step a CUDA graph captures). Returns (KL sum 0-d
    in the accumulation dtype, rows counted 0-d int64)."""
    rows_per = max(16, min(q.shape[0], 2 ** 26 // max(1, max_entries)))
    chunks = (static_chunks(q.shape[0], rows_per, max_entries) if static
              else warmup_chunks(first, nvis, rows_per))
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (inp.q, inp.w, inp.keys))
    return _DenseKL.apply(inp.q, inp.w, inp.keys, q.detach(), kv_all.detach(), first, nvis, chunks, backend, n_kv,
                          attn.softmax_scale, need_grad)


def attention_forward(attn, x: torch.Tensor, ctx, backend: Backend) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Same contract as ``Attention.forward(x, ctx)``: x [T, dim] (this rank's rows) -> (out [T, dim],
    KL 0-d or None), on one device or under context parallelism.

    Under CP the keys are the extended rows (``ctx.cp.extend``: B left-boundary rows, then the local
    rows) and the compressed entries the CP-gathered ``EntryMemory``, read in logical order; the
    query at local row t is extended row B + t, so its window range is [max(e - pos_e, e - W + 1), e]
    with e = B + t in ``kv``'s rows. The KL is summed and counted over CP ranks like the reference
    path (seed 000 §5; ``Attention.forward``).
    """
    T, H, D = x.shape[0], attn.n_heads, attn.head_dim
    ext, B = ctx.ext, ctx.shard.left
    cos, sin = ctx.cos_sin(attn.rope, x.dtype)
    xe = ctx.cp.extend(x, ctx.shard)  # [B + T, dim]
    cos_e, sin_e = ctx.cos_sin(attn.rope, x.dtype, extended=True)
    qr = attn.q_norm(linear(x, attn.wq_a))
    q = attn.project_query(qr, cos, sin)  # [T, H, D]
    kv = apply_rope(attn.kv_norm(linear(xe, attn.wkv)), cos_e, sin_e)  # [B + T, D]
    e = B + torch.arange(T, device=x.device)  # each query's extended row
    a_lo = torch.maximum(e - ext.pos[e], e - attn.window_size + 1)
    b_lo = b_hi = torch.zeros_like(e)
    comp = inp = idx = sel = None
    mems = []
    if attn.ratio:
        plan = ctx.plan(attn.ratio)
        if plan.n_entries and plan.max_entries:  # global counts: the same branch on every CP rank
            parts = [attn.compressor(xe, plan, attn.rope)]
            if attn.has_indexer:
                inp = attn.indexer.prepare(x, qr, ctx.pack.pos, plan, attn.rope, x_comp=xe)
                parts.append(inp.keys)
            mems = ctx.cp.gather(parts, plan, ctx.shard, gather_label(ctx.cp, attn.layer_id))
            comp = mems[0].rows(0, plan.n_entries)  # [C, D], logical order
            first, nvis = plan.seg_offset[ext.seg[e]], plan.n_visible[e]
            if inp is not None:
                inp.keys = mems[1].rows(0, plan.n_entries)  # [C, dI], logical order
                sel = backend.indexer_topk(inp.q, inp.w, inp.keys, first, nvis, attn.topk, plan.max_entries)
                idx = torch.where(sel >= 0, sel + kv.shape[0], -1).to(torch.int32)
            else:
                b_lo = kv.shape[0] + first
                b_hi = b_lo + nvis
    kv_all = kv if comp is None else torch.cat((kv, comp.to(kv.dtype)))
    ranges = torch.stack((a_lo, e + 1, b_lo, b_hi), 1).to(torch.int32)
    # the longest window and entry range any query has, known on the host (the plan's bound on a segment); beside
    # index columns, range 1 empty, the same bound holds their span (a query's columns are among its visible entries)
    bounds = (attn.window_size, plan.max_entries if comp is not None else 0)
    o, _lse, selected_lse = backend.sparse_sink_attention(q, kv_all, idx, attn.attn_sink, attn.softmax_scale, ranges,
                                                          bounds)
    o = apply_rope(o.to(x.dtype), cos, sin, inverse=True)
    o = o.view(T, attn.n_groups, H * D // attn.n_groups)
    wo_a = attn.wo_a.weight.view(attn.n_groups, attn.o_lora_rank, -1)
    o = torch.einsum("tgd,grd->tgr", o, wo_a.to(o.dtype)).flatten(1)
    out = ctx.cp.tie(linear(o, attn.wo_b), mems)
    if not attn.has_indexer:
        return out, None
    kl_sum, kl_rows = None, 0
    if inp is not None:
        if ctx.kl_target == "selected":
            valid = sel >= 0
            p_t = backend.head_avg_probs(q.detach(), kv_all.detach(), idx, attn.softmax_scale, selected_lse)
            student = backend.student_scores(inp.q, inp.w, inp.keys, sel)
            kl_sum, kl_rows = kl_from_probs(p_t, student, valid)
        else:
            if backend.dense_kl_fused(q, kv_all, inp.q, inp.keys):
                kl_sum, kl_rows = _fused_warmup_kl(attn, inp, q, kv_all, kv.shape[0], first, nvis, plan.max_entries,
                                                   backend, static=ctx.static)
            else:
                kl_sum, kl_rows = _warmup_kl(attn, inp, q.detach(), comp.detach(), first, nvis, plan.max_entries)
    if kl_sum is None:  # no compressed entry for these queries: an explicit zero
        kl_sum = sum(p.sum() for p in attn.indexer.parameters()) * 0.0
    kl_sum = ctx.cp.tie(kl_sum, mems)
    return out, ctx.cp.sum_partial(kl_sum) / ctx.cp.sum_counts(on_device_count(kl_rows, out.device)).clamp_min(1)
