"""One dispatch point for the attention kernels: ``select_backend(name, device) -> Backend``.

Names match the recipe's ``attention.kernel_backend`` Literal
(``validators/schema/attention.py``: reference | triton | cudnn).

* ``reference`` — plain PyTorch (``kernels/reference.py``), any device and dtype.
* ``triton``    — the Triton kernels on an SM90 GPU (H100/H200) with Triton importable;
  anywhere else it falls back to ``reference`` and says why in ``Backend.reason``.
  Per call, shapes the kernels do not cover (float64, head counts / dims that are not
  powers of two >= 16) also run the reference functions.
* ``cudnn``     — FlashMLA + cuDNN DSA kernels. Not shipped with v4launch: selecting it
  raises ``BackendUnavailable`` with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, get_args

import torch

from . import reference

KernelBackendName = str
BACKEND_NAMES: tuple[str, ...] = ("reference", "triton", "cudnn")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message names the fix."""


@dataclass(frozen=True)
class Backend:
    """The functions one backend provides (the reference signatures, with the two additions marked).

    sparse_sink_attention(q [T,H,D], kv [N,D], idx [T,K] int32 | None, sink [H], scale, ranges [T,4] | None,
        range_bounds=None) -> (out [T,H,D], lse [T,H], selected_lse [T,H] | None); differentiable in q, kv, sink.
        ``selected_lse`` (added): each head's log-sum-exp over the valid idx slots alone, where the backend's
        forward has it on the way (Triton), else None. ``range_bounds`` (added): (longest range 0, longest
        range 1; beside idx, range 1 empty, the longest span of a query's idx columns) in rows, host ints, or
        None; the Triton backward may use it (``triton_attention.QUERY_BLOCK_BACKWARD``).
    indexer_topk(q [T,HI,dI], w [T,HI], keys [C,dI], first [T], n_visible [T], topk, max_entries)
        -> idx [T, min(topk, max_entries)] int32 global entry ids, -1 = masked.
    head_avg_probs(q, kv, idx, scale, selected_lse=None) -> [T, K] float: the sparse-phase KL teacher;
        ``selected_lse`` (added) from the attention on the same q, kv, idx, scale spares it a pass (Triton; the
        reference recomputes it).
    student_scores(q [T,HI,dI], w [T,HI], keys [C,dI], sel [T,K]) -> [T, K] float32: the sparse-phase KL
        student (indexer scores at the selection); differentiable in q, w, keys.
    logsumexp_target(z [R,V], labels [R]) -> (lse [R], loss [R]) and
    softmax_grad(z [R,V], lse [R], labels [R], scale [R], out_dtype) -> dz [R,V]: the row passes of the
        chunked head cross entropy (``loss.head_cross_entropy``), not differentiable themselves.
    """

    name: str
    requested: str
    reason: str
    sparse_sink_attention: Callable
    indexer_topk: Callable
    head_avg_probs: Callable
    student_scores: Callable
    logsumexp_target: Callable
    softmax_grad: Callable
    dense_kl_fused: Callable = lambda q, kv, iq, keys: False
    """dense_kl_fused(q [T,H,D], kv [N,D], iq [T,HI,dI], keys [C,dI]) -> bool: whether the warm-up KL may run
    ``head_avg_probs`` and ``student_scores`` with every visible entry as the selection (``layer._DenseKL``): only
    where both run as kernels, whose memory does not grow with the selection's width; the reference functions
    gather [rows, entries, D] (``layer._warmup_kl``'s chunked einsums run instead)."""
    dense_head_avg_probs: Optional[Callable] = None
    """dense_head_avg_probs(q [T,H,D], kv [N,D], lo [T], n_visible [T], width, scale) -> [T, width] float32, or None:
    the warm-up KL teacher with query t's selection the kv rows lo[t] .. lo[t] + n_visible[t] - 1 read as a range
    (Triton: ``triton_dense_teacher``); None: ``head_avg_probs`` over that selection written as a table. Call it
    through :meth:`visible_head_avg_probs`."""

    def visible_head_avg_probs(self, q: torch.Tensor, kv: torch.Tensor, lo: torch.Tensor, n_visible: torch.Tensor,
                               width: int, scale: float) -> torch.Tensor:
        """The KL teacher over every visible entry: q [T, H, D], kv [N, D], query t's entries the kv rows
        ``lo[t] + j`` for j < ``n_visible[t]`` (<= ``width``) -> [T, width] float32, slot j of row t that entry's
        head-averaged probability, 0 past ``n_visible[t]``. No gradient. The warm-up KL's teacher (seed 000 §3:
        the main attention's head-averaged distribution over every visible compressed entry). Raises nothing of its
        own; the entries must lie inside ``kv`` (``layer._DenseKL`` passes each query's visible ones)."""
        if self.dense_head_avg_probs is not None:
            return self.dense_head_avg_probs(q, kv, lo, n_visible, width, scale)
        return self.head_avg_probs(q, kv, reference.range_selection(lo, n_visible, width), scale)


def _triton_problem(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"device {device} is not a CUDA GPU"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"GPU compute capability {cap[0]}.{cap[1]} is not SM90 (kernels are tuned and tested on H100/H200)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _triton_backend(requested: str) -> Backend:
    from . import triton_attention as ta
    from . import triton_cross_entropy as tce
    from . import triton_dense_teacher as td
    from . import triton_indexer as ti
    from . import triton_student as ts

    def attn(q, kv, idx, sink, scale, ranges=None, range_bounds=None):
        if ta.supported(q, kv):
            return ta.sparse_sink_attention_with_selected_lse(q, kv, idx, sink, scale, ranges, range_bounds)
        return (*reference.sparse_sink_attention(q, kv, idx, sink, scale, ranges), None)

    def topk(q, w, keys, first, n_visible, k, max_entries):
        if ti.supported(q):
            return ti.indexer_topk(q, w, keys, first, n_visible, k, max_entries)
        return reference.indexer_topk(q, w, keys, first, n_visible, k, max_entries)

    def teacher(q, kv, idx, scale, selected_lse=None):
        if ta.supported(q, kv) and q.dtype != torch.float32:  # fp32: all heads of a query do not fit in smem
            return ta.head_avg_probs(q, kv, idx, scale, selected_lse)
        return reference.head_avg_probs(q, kv, idx, scale)

    def student(q, w, keys, sel):
        if ts.supported(q, keys):
            return ts.student_scores(q, w, keys, sel)
        return reference.student_scores(q, w, keys, sel)

    def lse_target(z, labels):
        if tce.supported(z):
            return tce.logsumexp_target(z, labels)
        return reference.logsumexp_target(z, labels)

    def ce_grad(z, lse, labels, scale, out_dtype):
        if tce.supported(z):
            return tce.softmax_grad(z, lse, labels, scale, out_dtype)
        return reference.softmax_grad(z, lse, labels, scale, out_dtype)

    def dense_kl_fused(q, kv, iq, keys):  # the teacher's and student's kernel conditions above
        return ta.supported(q, kv) and q.dtype != torch.float32 and ts.supported(iq, keys)

    def dense_teacher(q, kv, lo, n_visible, width, scale):
        if td.supported(q, kv):
            return td.dense_head_avg_probs(q, kv, lo, n_visible, width, scale)
        return teacher(q, kv, reference.range_selection(lo, n_visible, width), scale)

    return Backend("triton", requested, "SM90 GPU with Triton", attn, topk, teacher, student, lse_target, ce_grad,
                   dense_kl_fused, dense_teacher)


def _reference_backend(requested: str, reason: str) -> Backend:
    def attn(q, kv, idx, sink, scale, ranges=None, range_bounds=None):
        return (*reference.sparse_sink_attention(q, kv, idx, sink, scale, ranges), None)

    def teacher(q, kv, idx, scale, selected_lse=None):
        return reference.head_avg_probs(q, kv, idx, scale)

    return Backend("reference", requested, reason, attn, reference.indexer_topk,
                   teacher, reference.student_scores, reference.logsumexp_target,
                   reference.softmax_grad)


def select_backend(name: str, device: torch.device | str | None = None) -> Backend:
    """Pick the kernels for ``attention.kernel_backend = name`` on ``device``.

    Raises:
        ValueError: unknown name.
        BackendUnavailable: ``cudnn`` (FlashMLA + cuDNN DSA kernels are not installed).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"kernel_backend={name!r}: must be one of {BACKEND_NAMES}. "
                         "Fix: set attention.kernel_backend to reference, triton or cudnn.")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if name == "cudnn":
        raise BackendUnavailable(
            "kernel_backend='cudnn' needs the FlashMLA sparse kernels and cuDNN's DSA attention, which v4launch "
            "does not ship and which are not installed here. Fix: use kernel_backend='triton' (SM90) or "
            "'reference' (any device).")
    if name == "reference":
        return _reference_backend(name, "requested")
    problem = _triton_problem(device)
    if problem is not None:
        return _reference_backend(name, f"triton requested but {problem}: using the reference kernels")
    return _triton_backend(name)


def schema_names() -> tuple[str, ...]:
    """The names allowed by the recipe schema (``KernelBackend`` Literal), for consistency checks."""
    from v4launch.validators.schema.attention import KernelBackend

    return get_args(KernelBackend)
