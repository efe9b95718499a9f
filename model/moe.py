"""Mixture of experts: sqrtsoftplus router (learned or hash), SwiGLU experts, balance loss.

Spec: reference/v4-model-spec.md §3 "Router", "Expert (SwiGLU with clamp)",
"Load balancing"; seed 004 item 7a (sequence-wise loss, magnitude pinned).
Upstream: ``Gate``, ``Expert`` and ``MoE`` in the released ``inference/model.py``
(shared expert clamped, as since 2026-04-27).

Router: ``s = sqrt(softplus(x W^T))`` in float32; experts = top-k of ``s + bias``
(learned layers) or ``tid2eid[token]`` (the first ``n_hash_layers`` layers); weights =
``s`` at the chosen experts, divided by their sum, times ``route_scale``. The bias is
a no-grad buffer moved by :meth:`MoE.update_bias` (aux-loss-free balancing).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .common import FP32Pinned, acc_dtype, linear


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, seg: torch.Tensor, n_segments: int,
                          n_experts: int, cp=None) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss WITHOUT alpha, averaged over packed segments.

    Per segment b with T_b tokens and top-k K:
    ``f_i = E / (K T_b) * #{t: i in topk_t}``, ``P_i = (1/T_b) sum_t s_it / sum_j s_jt``,
    ``L_b = sum_i f_i P_i``. Perfect balance gives 1; collapse onto K experts (f and P)
    gives E / K. ``f`` counts the real routing (no gradient); ``P`` carries the gradient.

    Args:
        scores: [T, E] unbiased router affinities s (>= 0). indices: [T, K] chosen experts.
        seg: [T] segment id of each token.
        cp: context-parallel hooks (``parallel.ContextParallel``) or None. Under CP the rows
            are one rank's slice, ``seg`` holds global segment ids; f and T_b are summed over
            ranks and ``L`` (linear in P) is the replicated sum of the ranks' partial sums.
    Returns: 0-d tensor (accumulation dtype of ``scores``).
    """
    T, K = indices.shape
    chosen = torch.zeros(T, n_experts, dtype=scores.dtype, device=scores.device)
    chosen.scatter_(1, indices, 1.0)  # [T, E] one-hot of the routing
    counts = torch.zeros(n_segments, n_experts, dtype=scores.dtype, device=scores.device).index_add_(0, seg, chosen)
    p_norm = scores / scores.sum(dim=-1, keepdim=True)
    p_sum = torch.zeros_like(counts).index_add_(0, seg, p_norm)  # [N, E]
    t_b = torch.bincount(seg, minlength=n_segments).to(scores.dtype)  # [N]
    if cp is not None and cp.size > 1:
        counts, t_b = cp.sum_counts(counts), cp.sum_counts(t_b)  # global f and T_b (no gradient)
        per_seg = (counts * p_sum).sum(dim=1) * n_experts / (K * t_b * t_b)  # this rank's share of P
        return cp.sum_partial(per_seg.sum()) / n_segments
    per_seg = (counts * p_sum).sum(dim=1) * n_experts / (K * t_b * t_b)
    return per_seg.mean()


class Gate(FP32Pinned):
    """Router. Parameters: ``weight`` [E, dim]; buffer ``bias`` [E] (FP32-pinned, learned
    layers) or ``tid2eid`` [vocab, K] int32 (hash layers)."""

    _fp32_names = ("bias",)

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.topk, self.route_scale = args.n_activated_experts, args.route_scale
        self.is_hash = layer_id < args.n_hash_layers
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        if self.is_hash:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + layer_id)
            draw = torch.rand(args.vocab_size, args.n_routed_experts, generator=g, device="cpu")
            table = draw.topk(self.topk, dim=1).indices.to(torch.int32)  # [vocab, K] distinct experts per token
            self.register_buffer("tid2eid", table.to(self.weight.device))
        else:
            self.register_buffer("bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim], token_ids [T] -> (weights [T, K] acc dtype, indices [T, K] int64, scores [T, E])."""
        scores = F.softplus(linear(x, self, acc_dtype(x.dtype))).sqrt()  # [T, E]
        if self.is_hash:
            indices = self.tid2eid[token_ids].long()
        else:
            indices = (scores.detach() + self.bias.to(scores.dtype)).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        return weights / weights.sum(dim=-1, keepdim=True) * self.route_scale, indices, scores


class Expert(nn.Module):
    """SwiGLU expert: ``w2((silu(min(w1 x, L)) * clamp(w3 x, -L, L)) * weight)``.

    The routing weight multiplies before ``w2``; gate/up math in float32. L = 0 disables the clamp.
    """

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [n, dim], weights [n, 1] or None -> [n, dim] in x's dtype."""
        acc = acc_dtype(x.dtype)
        gate, up = linear(x, self.w1).to(acc), linear(x, self.w3).to(acc)
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = h * weights
        return linear(h.to(x.dtype), self.w2)


class MoE(nn.Module):
    """Routed experts + one shared expert. x [T, dim] -> (y [T, dim], balance loss 0-d).

    Every expert runs (possibly on zero rows) so each gets a gradient tensor every step.
    Expert token counts of forwards in training mode accumulate in ``expert_counts``
    (non-persistent buffer) for :meth:`update_bias`.
    """

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts, self.topk = args.n_routed_experts, args.n_activated_experts
        self.gate = Gate(layer_id, args)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                                     for _ in range(self.n_experts))
        self.shared_experts = (Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                               if args.n_shared_experts else None)
        self.register_buffer("expert_counts", torch.zeros(self.n_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, seg: torch.Tensor,
                n_segments: int, cp=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (y [T, dim], balance loss); ``cp``: see :func:`sequence_balance_loss`."""
        weights, indices, scores = self.gate(x, token_ids)  # [T, K], [T, K], [T, E]
        flat = indices.flatten()  # [T*K]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        if self.training:
            self.expert_counts += counts
        token_of = order // self.topk  # [T*K] token of each sorted slot
        xs, ws = x[token_of], weights.flatten()[order, None]  # [T*K, dim], [T*K, 1]
        outs = [expert(xe, we) for expert, xe, we in
                zip(self.experts, xs.split(counts.tolist()), ws.split(counts.tolist()))]
        y = torch.zeros(x.shape, dtype=acc_dtype(x.dtype), device=x.device)
        y = y.index_add(0, token_of, torch.cat(outs).to(y.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).to(y.dtype)
        loss = sequence_balance_loss(scores, indices, seg, n_segments, self.n_experts, cp)
        return y.to(x.dtype), loss

    @torch.no_grad()
    def update_bias(self, speed: float) -> None:
        """Aux-loss-free step: ``bias_i += speed * sign(mean(count) - count_i)``, then reset counts.

        Under-loaded experts become more likely to be chosen (DeepSeek-V3 §2.1.2). Hash
        layers have no bias; only their counts are reset. Counts of all forwards in
        training mode since the last call are used (the job all-reduces ``expert_counts``
        across data-parallel ranks first if it wants the global load).
        """
        if not self.gate.is_hash and bool(self.expert_counts.sum() > 0):
            load = self.expert_counts.to(torch.float64)
            err = load.mean() - load
            self.gate.bias += (speed * torch.sign(err)).to(self.gate.bias.dtype)
        self.expert_counts.zero_()
