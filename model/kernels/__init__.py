"""Attention kernels for the V4 model: reference (PyTorch) and Triton (SM90) backends.

    from v4launch.model.kernels import select_backend, attention_forward
    backend = select_backend(recipe.attention.kernel_backend, device)   # reference | triton | cudnn
    out, kl = attention_forward(layer.attn, x, ctx, backend)            # drop-in for Attention.forward

Triton is imported only when the triton backend is selected on an SM90 GPU.
See docs/kernels.md.
"""

from .dispatch import BACKEND_NAMES, Backend, BackendUnavailable, select_backend
from .layer import attention_forward

__all__ = ["BACKEND_NAMES", "Backend", "BackendUnavailable", "select_backend", "attention_forward"]
