"""Triton kernels (SM90): the sparse-phase KL student, the indexer's scores at its own selection.

``s[t, k] = sum_h w[t, h] * relu(q[t, h] . keys[sel[t, k]])`` and its gradients in q, w and keys,
the K selected entries in blocks of ``BK``, the indexer heads in blocks of ``HB`` (16):

* forward: one program per query row, each key block gathered once and scored by every head block;
* backward, two kernels: dq and dw with one program per (query row, head block), which keeps the
  [HB, dI] float32 dq in registers over all K entries; the key gradient with one program per row, the
  head blocks' ``gl^T q`` summed in registers per key block before the reductions. Each recomputes the
  logits (one more [HB, dI] x [dI, BK] product per block than a single pass). With one head block
  (HI = 16, the bench shape) the key-gradient kernel computes dq and dw as well, in one pass, as before.

Before the head blocks, one program held all heads of a row: at the benchmark's 16 indexer heads that was
1.1 ms per backward call, but at V4-Flash's 64 heads x 128 its tiles spilled registers and the student took
3.1 of the 7.0 s of a 4-layer, 64K-token sparse step on an H200, 45% of the GPU time, at 2-3 TFLOP/s
(benchmarks/results/flash_width_h200_2026-12-04.md). In detail, per block:

* forward: gather the block's key rows, matrix products [HB, dI] x [dI, BK] (float32
  accumulation: for bf16 inputs every product is exact, as in the reference's float32 einsum),
  ReLU and the head weights fused; nothing but the [T, K] scores is written;
* backward: recompute the block's logits, then ``dw`` and ``dq`` accumulate in registers and the
  key gradient of the block, ``gl^T q`` [BK, dI], is added to a float32 [C, dI] buffer with
  relaxed ``red.global.add.v2.f32`` reductions on column pairs (``triton_attention.red_add_rows``;
  rows of one query are distinct entries; rows of different queries collide).
  Its two matrix products, ``gl kt^T`` and ``gl^T q``, must not round the float32 ``gl`` to bf16 (the
  gradient ``p_s - p_t`` would lose its low bits). For bf16 operands each runs as two bf16
  tensor-core products over ``gl = hi + lo`` (``hi = bf16(gl)``, ``lo = bf16(gl - hi)``): q and the
  keys are exact in bf16 and ``hi + lo`` carries 16 of gl's 24 significand bits, so the sums differ
  from float32 math by ~2^-17 relative per term, below the bf16 rounding of dq and d keys themselves
  (the split-operand scheme of "3xTF32"-style emulation, with bf16 parts). Before this the products
  ran in float32 on the CUDA cores (``ieee``, still used for fp16 / fp32 operands), about 4 ms per CSA
  layer of the benchmark's backward.

The reference (``reference.student_scores``) materialises the gathered keys and the per-slot key
gradient, [rows, K, dI] float32 each, and scatters the latter with ``index_add_``. At the benchmark's
shape (8,192 rows, K = 512, dI = 128, four CSA layers) the compiled sparse step's device time went from
259 to 207 ms per step on an H200 with these kernels, which take 1.7 ms forward and 17.8 ms backward
(benchmarks/results/train_step_h200.md). The atomics make the key gradient's summation order
vary between runs, as the attention backward's dKV reductions do: the ``triton`` backend as a whole is
reproducible to rounding, not bitwise, under ``torch.use_deterministic_algorithms(True)`` too (a bitwise
GPU run takes ``kernel_backend: reference``). Running the reference student there (as until 2026-12-01)
made a deterministic-mode run slower without making it bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention_common import red_add_rows

BK = 64
HB = 16
"""Indexer heads per matrix product: a program never holds more than [HB, dI] of q or [HB, BK] of logits, so the
register use does not grow with the head count (module docstring: 64 heads in one tile spilled)."""
BK_KEYS = 64
WARPS_KEYS = 4
"""Key block and warps of the key-gradient kernel, whose [BK_KEYS, dI] float32 accumulator is its largest tile
(module globals so benchmarks/student_keys_sweep.py can time other values)."""
@triton.jit
def _student_fwd(Q, W, KEYS, SEL, OUT, K, sq_t, sq_h, sw_t, ss_t, so_t,
                 HI: tl.constexpr, DI: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr, PREC: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HB)
    offs_d = tl.arange(0, DI)
    for k0 in range(0, K, BK):
        ks, kmask, _, ent, kt = _key_block(KEYS, SEL, r, ss_t, k0, K, offs_d, DI, BK)
        s = tl.zeros([BK], tl.float32)
        for h0 in tl.static_range(0, HI, HB):
            q = tl.load(Q + r * sq_t + (h0 + offs_h)[:, None] * sq_h + offs_d[None, :])  # [HB, DI]
            w = tl.load(W + r * sw_t + h0 + offs_h).to(tl.float32)  # [HB]
            logits = tl.dot(q, kt, input_precision=PREC)  # [HB, BK] float32
            s += tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
        tl.store(OUT + r * so_t + ks, s, mask=kmask)


@triton.jit
def _key_block(KEYS, SEL, r, ss_t, k0, K, offs_d, DI: tl.constexpr, BK: tl.constexpr):
    """Key block ``k0`` of row ``r``: (slots [BK], in range [BK], selected [BK] (in range and not -1), entry ids
    [BK] int64 (0 where not selected), the gathered keys transposed [DI, BK])."""
    ks = k0 + tl.arange(0, BK)
    kmask = ks < K
    raw = tl.load(SEL + r * ss_t + ks, mask=kmask, other=-1)
    ent = tl.maximum(raw, 0).to(tl.int64)
    kt = tl.load(KEYS + ent[None, :] * DI + offs_d[:, None], mask=kmask[None, :], other=0.0)
    return ks, kmask, raw >= 0, ent, kt


@triton.jit
def _logit_grad(q, w, kt, G, r, sg_t, ks, kmask, ok, PREC: tl.constexpr):
    """(relu(logits) [HB, BK], d logits [HB, BK]) of one head block and key block: ``w * g`` where logit > 0."""
    logits = tl.dot(q, kt, input_precision=PREC)  # [HB, BK]
    g = tl.load(G + r * sg_t + ks, mask=ok & kmask, other=0.0).to(tl.float32)  # [BK], 0 at masked slots
    return tl.maximum(logits, 0.0) * g[None, :], tl.where(logits > 0, w[:, None] * g[None, :], 0.0)


@triton.jit
def _student_bwd_q(Q, W, KEYS, SEL, G, DQ, DW, K, sq_t, sq_h, sw_t, ss_t, sg_t,
                   HI: tl.constexpr, DI: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr, PREC: tl.constexpr,
                   SPLIT: tl.constexpr):
    """dq [HB, dI] and dw [HB] of one (query row, head block) program, over all K selected entries."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    offs_d = tl.arange(0, DI)
    q = tl.load(Q + r * sq_t + offs_h[:, None] * sq_h + offs_d[None, :])  # [HB, DI]
    w = tl.load(W + r * sw_t + offs_h).to(tl.float32)
    dq = tl.zeros([HB, DI], tl.float32)
    dw = tl.zeros([HB], tl.float32)
    for k0 in range(0, K, BK):
        ks, kmask, ok, ent, kt = _key_block(KEYS, SEL, r, ss_t, k0, K, offs_d, DI, BK)
        act_g, gl = _logit_grad(q, w, kt, G, r, sg_t, ks, kmask, ok, PREC)
        dw += tl.sum(act_g, 1)
        if SPLIT:  # gl = hi + lo, both bf16: two tensor-core products, every product exact
            gl_hi = gl.to(tl.bfloat16)
            gl_lo = (gl - gl_hi.to(tl.float32)).to(tl.bfloat16)
            dq = tl.dot(gl_lo, tl.trans(kt), dq)
            dq = tl.dot(gl_hi, tl.trans(kt), dq)  # [HB, DI]
        else:
            dq += tl.dot(gl, tl.trans(kt.to(tl.float32)), input_precision="ieee")
    tl.store(DQ + r * HI * DI + offs_h[:, None] * DI + offs_d[None, :], dq)
    tl.store(DW + r * HI + offs_h, dw)


@triton.jit
def _student_bwd_keys(Q, W, KEYS, SEL, G, DKEYS, DQ, DW, K, sq_t, sq_h, sw_t, ss_t, sg_t,
                      HI: tl.constexpr, DI: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr, PREC: tl.constexpr,
                      SPLIT: tl.constexpr, USE_ASM: tl.constexpr, FUSED: tl.constexpr):
    """The key gradient of one query row: per key block, sum over the head blocks of ``gl^T q`` [BK, dI], added
    to DKEYS's selected rows with relaxed float32 reductions. FUSED (one head block,
    HI == HB): dq and dw of the row too, in the same pass (then :func:`_student_bwd_q` is not launched)."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HB)
    offs_d = tl.arange(0, DI)
    dq = tl.zeros([HB, DI], tl.float32)
    dw = tl.zeros([HB], tl.float32)
    for k0 in range(0, K, BK):
        ks, kmask, ok, ent, kt = _key_block(KEYS, SEL, r, ss_t, k0, K, offs_d, DI, BK)
        dk = tl.zeros([BK, DI], tl.float32)
        for h0 in tl.static_range(0, HI, HB):
            q = tl.load(Q + r * sq_t + (h0 + offs_h)[:, None] * sq_h + offs_d[None, :])  # [HB, DI]
            w = tl.load(W + r * sw_t + h0 + offs_h).to(tl.float32)
            act_g, gl = _logit_grad(q, w, kt, G, r, sg_t, ks, kmask, ok, PREC)
            if FUSED:
                dw += tl.sum(act_g, 1)
            if SPLIT:
                gl_hi = gl.to(tl.bfloat16)
                gl_lo = (gl - gl_hi.to(tl.float32)).to(tl.bfloat16)
                if FUSED:
                    dq = tl.dot(gl_lo, tl.trans(kt), dq)
                    dq = tl.dot(gl_hi, tl.trans(kt), dq)
                dk = tl.dot(tl.trans(gl_lo), q, dk)
                dk = tl.dot(tl.trans(gl_hi), q, dk)  # [BK, DI]
            else:
                if FUSED:
                    dq += tl.dot(gl, tl.trans(kt.to(tl.float32)), input_precision="ieee")
                dk += tl.dot(tl.trans(gl), q.to(tl.float32), input_precision="ieee")
        red_add_rows(DKEYS, ent, ok & kmask, dk, 0, DI, USE_ASM)
    if FUSED:
        tl.store(DQ + r * HI * DI + offs_h[:, None] * DI + offs_d[None, :], dq)
        tl.store(DW + r * HI + offs_h, dw)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for bf16 / fp16 operands


def _operands(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor):
    """The kernels' operands: q and keys as they are (one dtype), everything contiguous, sel int32.

    Raises:
        ValueError: q and keys of two dtypes. Promoting them (as this did) ran bf16 queries beside float32 keys
            as float32 ``ieee`` products on the CUDA cores, ~24x slower and silent (a CSA first layer's float32
            keys, 1.37 s of one Flash-width backward); the caller casts (``Indexer.prepare`` gives the keys the
            queries' dtype)."""
    if q.dtype != keys.dtype:
        raise ValueError(f"KL student kernels: q is {q.dtype} and keys {keys.dtype}; they take one dtype (mixed, "
                         "the products would run in float32 on the CUDA cores, ~24x slower). Fix: cast the keys to "
                         "q's dtype, as Indexer.prepare does")
    return q.contiguous(), w.contiguous(), keys.contiguous(), sel.to(torch.int32).contiguous()


@torch.library.custom_op("v4launch::student_scores", mutates_args=())
def _student_op(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    qc, wc, kc, selc = _operands(q, w, keys, sel)
    T, HI, DI = qc.shape
    K = selc.shape[1]
    out = torch.empty(T, K, dtype=torch.float32, device=q.device)
    if T and K:
        _student_fwd[(T,)](qc, wc, kc, selc, out, K, qc.stride(0), qc.stride(1), wc.stride(0), selc.stride(0),
                           out.stride(0), HI=HI, DI=DI, BK=BK, HB=min(HB, HI), PREC=_prec(qc.dtype), num_warps=4)
    return out


@_student_op.register_fake
def _student_shapes(q, w, keys, sel):
    return q.new_empty((q.shape[0], sel.shape[1]), dtype=torch.float32)


def student_scores_backward(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor,
                            g: torch.Tensor, *, split: bool | None = None, vector_red: bool | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`student_scores` given ``g`` = d loss / d scores [T, K]: (dq [T, HI, dI] like q,
    dw [T, HI] like w, d keys [C, dI] like keys). The defaults are what the training step runs; the two switches
    exist for benchmarks/student_kernel.py, which times each against the other:

    * ``split``: the two gradient products as bf16 hi + lo pairs on the tensor cores (default for bf16
      operands) instead of float32 on the CUDA cores (``ieee``: the default for fp16 / fp32);
    * ``vector_red``: the key gradient added with ``red.global.add.v2.f32`` on column pairs
      (``triton_attention.red_add_rows``; default on CUDA) instead of ``tl.atomic_add`` per element.

    Raises: ValueError for ``split=True`` with operands that are not bf16."""
    qc, wc, kc, selc = _operands(q, w, keys, sel)
    split = qc.dtype == torch.bfloat16 if split is None else split
    if split and qc.dtype != torch.bfloat16:
        raise ValueError(f"student backward: split=True needs bf16 q and keys, got {qc.dtype}")
    T, HI, DI = qc.shape
    K = selc.shape[1]
    g = g.to(torch.float32).contiguous()
    dq = torch.empty(T, HI, DI, dtype=torch.float32, device=g.device)
    dw = torch.empty(T, HI, dtype=torch.float32, device=g.device)
    dkeys = torch.zeros(kc.shape, dtype=torch.float32, device=g.device)
    if T and K:
        hb = min(HB, HI)
        common = (qc, wc, kc, selc, g)
        strides = (K, qc.stride(0), qc.stride(1), wc.stride(0), selc.stride(0), g.stride(0))
        fused = hb == HI
        if not fused:
            _student_bwd_q[(T, HI // hb)](*common, dq, dw, *strides, HI=HI, DI=DI, BK=BK, HB=hb,
                                          PREC=_prec(qc.dtype), SPLIT=split, num_warps=4)
        use_asm = qc.is_cuda if vector_red is None else vector_red
        _student_bwd_keys[(T,)](*common, dkeys, dq, dw, *strides, HI=HI, DI=DI, BK=BK if fused else BK_KEYS,
                                HB=hb, PREC=_prec(qc.dtype), SPLIT=split, USE_ASM=use_asm, FUSED=fused,
                                num_warps=4 if fused else WARPS_KEYS)
    else:
        dq.zero_()
        dw.zero_()
    return dq.to(q.dtype), dw.to(w.dtype), dkeys.to(keys.dtype)


@torch.library.custom_op("v4launch::student_scores_backward", mutates_args=())
def _student_backward_op(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor,
                         g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return student_scores_backward(q, w, keys, sel, g)


@_student_backward_op.register_fake
def _student_backward_shapes(q, w, keys, sel, g):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(w, memory_format=torch.contiguous_format),
            torch.empty_like(keys, memory_format=torch.contiguous_format))


def _student_save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _student_grads(ctx, g):
    q, w, keys, sel = ctx.saved_tensors
    dq, dw, dkeys = _student_backward_op(q, w, keys, sel, g)
    return dq, dw, dkeys, None


_student_op.register_autograd(_student_grads, setup_context=_student_save)


def student_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`reference.student_scores` (same arguments, [T, K] float32 result,
    gradients in q, w and keys). A custom operator (``torch.ops.v4launch.student_scores``, its backward
    another): a compiled caller keeps one graph around it and never traces into the kernels. Raises nothing
    itself; :func:`supported` says which shapes it takes."""
    return _student_op(q, w, keys, sel)


def supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Shapes and dtypes the kernels take: CUDA, bf16 / fp16 / fp32, head count and head dim powers of
    two >= 16 (the matrix-product tile minimum). Deterministic mode does not matter (module docstring)."""
    HI, DI = q.shape[1], q.shape[2]
    pow2 = all(n >= 16 and n & (n - 1) == 0 for n in (HI, DI))
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and keys.dtype in (torch.bfloat16, torch.float16, torch.float32) and pow2)
