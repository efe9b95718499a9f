"""Injection point for a later context-parallel (CP) runtime.

Spec: seed 000 §5 (boundary exchange, compressed ownership) and style "For v4launch"
rule 2: math modules never import ``torch.distributed``; a CP implementation
subclasses :class:`ContextParallel` (in this module or a sibling) and is passed to
``V4Model(..., cp=...)``. The single-device default below does nothing.
"""

from __future__ import annotations

import torch


class ContextParallel:
    """Single-device default: every hook returns its input unchanged."""

    def window_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """Window KV [T_local, head_dim] -> KV including the left-boundary rows a CP rank needs."""
        return kv

    def compressed(self, entries: torch.Tensor) -> torch.Tensor:
        """Local compressed entries [C_local, d] -> all entries a local query may select [C, d]."""
        return entries


SINGLE_DEVICE = ContextParallel()
