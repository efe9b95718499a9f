"""Whole model (API surface; math filled in by the following commits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch import nn

from .args import ModelArgs

Phase = Literal["dense", "warmup", "sparse"]
AUX_LOSS_DOC = {}


@dataclass
class ModelOutput:
    lm_loss: Optional[torch.Tensor]
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    logits: Optional[torch.Tensor] = None


class V4Model(nn.Module):
    def __init__(self, args: ModelArgs, phase: Phase = "dense", cp=None) -> None:
        super().__init__()
        self.args = args
        self.phase = phase

    @property
    def has_indexer(self) -> bool:
        return self.phase != "dense"

    def set_phase(self, phase: Phase) -> None:
        raise NotImplementedError

    def forward(self, tokens, cu_seqlens, max_seqlen, labels=None, return_logits=False) -> ModelOutput:
        raise NotImplementedError

    @torch.no_grad()
    def update_router_bias(self, speed: float) -> None:
        raise NotImplementedError
