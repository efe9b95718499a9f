"""Multi-token prediction block (depth k predicts the token k+1 ahead).

Spec: reference/v4-model-spec.md §3 "MTP" (own block with SWA attention and non-hash
MoE, own ``hc_head_*`` and ``norm``, SHARED embed and head); seed 000 §12 item 8.
Upstream: ``MTPBlock`` in the released ``inference/model.py``; ``convert.py`` drops
the MTP copies of embed and head, so this module does not register them: the shared
modules are passed to :meth:`MTPBlock.forward` instead (state-dict keys stay released).

Depth k (1-based) at token t combines the streams h of depth k-1 at t (main model
final streams for k = 1) with the embedding of token t+k of the same segment:
``x = e_proj(enorm(embed(tok_{t+k}))) + h_proj(hnorm(h))`` (e_proj broadcast over the
streams), then the block, then ``hc_head`` + ``norm`` + shared ``head``.
"""

from __future__ import annotations

import torch
from torch import nn

from .args import ModelArgs
from .common import RMSNorm, linear
from .mhc import hc_head


class MTPBlock(nn.Module):
    """Mixin body for the MTP layer; the concrete class is ``model.MTPLayer`` (Block + this).

    Extra parameters: ``e_proj``, ``h_proj`` [dim, dim], ``enorm``, ``hnorm``, ``norm``,
    ``hc_head_fn`` [hc, hc*dim], ``hc_head_base`` [hc], ``hc_head_scale`` [1] (FP32-pinned).
    """

    _mtp_fp32 = ("hc_head_fn", "hc_head_base", "hc_head_scale")

    def _init_mtp(self, args: ModelArgs) -> None:
        d, hc = args.dim, args.hc_mult
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, args.norm_eps)
        self.hnorm = RMSNorm(d, args.norm_eps)
        self.norm = RMSNorm(d, args.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def mtp_input(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h [T, hc, dim] streams, e [T, dim] shifted-token embeddings -> block input streams [T, hc, dim]."""
        return linear(self.enorm(e), self.e_proj).unsqueeze(1) + linear(self.hnorm(h), self.h_proj)

    def mtp_hidden(self, h: torch.Tensor, hc_eps: float, norm_eps: float) -> torch.Tensor:
        """Streams [T, hc, dim] -> normed hidden [T, dim] for the shared head."""
        x = hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, hc_eps, norm_eps)
        return self.norm(x)
