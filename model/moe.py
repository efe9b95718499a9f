"""Mixture of experts: sqrtsoftplus router (learned or hash), SwiGLU experts, balance loss.

Spec: reference/v4-model-spec.md §3 "Router", "Expert (SwiGLU with clamp)",
"Load balancing"; seed 004 item 7a (sequence-wise loss, magnitude pinned);
docs/parallelism.md "Expert parallel". Upstream: ``Gate``, ``Expert`` and ``MoE`` in the
released ``inference/model.py`` (shared expert clamped, as since 2026-04-27).

Router: ``s = sqrt(softplus(x W^T))`` in float32; experts = top-k of ``s + bias``
(learned layers) or ``tid2eid[token]`` (the first ``n_hash_layers`` layers); weights =
``s`` at the chosen experts, divided by their sum, times ``route_scale``. The bias is
a no-grad buffer moved by :meth:`MoE.update_bias` (aux-loss-free balancing).

Routed experts: one :class:`Expert` module each (released names ``experts.<id>.w1`` ...),
held in a ``ModuleDict`` keyed by the GLOBAL expert id so an expert-parallel rank keeps
only its own. The local experts run as one grouped GEMM (:func:`run_local_experts`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8_experts, regions
from .args import ModelArgs
from .common import FP32Pinned, acc_dtype, linear
from .parallel.base import SINGLE_DEVICE_EXPERTS, ExpertDispatch


@torch.compiler.disable
def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, seg: torch.Tensor, n_segments: int,
                          n_experts: int, cp=None) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss WITHOUT alpha, averaged over packed segments.

    Per segment b with T_b tokens and top-k K:
    ``f_i = E / (K T_b) * #{t: i in topk_t}``, ``P_i = (1/T_b) sum_t s_it / sum_j s_jt``,
    ``L_b = sum_i f_i P_i``. Perfect balance gives 1; collapse onto K experts (f and P)
    gives E / K. ``f`` counts the real routing (no gradient); ``P`` carries the gradient.

    Args:
        scores: [T, E] unbiased router affinities s (>= 0). indices: [T, K] chosen experts.
        seg: [T] segment id of each token. n_segments: N, the rows of the per-segment tables (under
            ``packing.pad_pack`` empty segments follow the real ones; the mean is over non-empty segments).
        cp: context-parallel hooks (``parallel.ContextParallel``) or None. Under CP the rows
            are one rank's slice, ``seg`` holds global segment ids; f and T_b are summed over
            ranks and ``L`` (linear in P) is the replicated sum of the ranks' partial sums.
    Returns: 0-d tensor (accumulation dtype of ``scores``).

    Never compiled (``torch.compiler.disable``: a compiled block splits around it). Inside compiled blocks on
    an H200 (torch 2.11, inductor) it returned ~150,000 instead of ~1 per layer at some steps (a per-segment
    token count computed by a scatter of ones came out too small); the eager code is the tested one.
    """
    T, K = indices.shape
    chosen = torch.zeros(T, n_experts, dtype=scores.dtype, device=scores.device)
    chosen.scatter_(1, indices, 1.0)  # [T, E] one-hot of the routing
    counts = torch.zeros(n_segments, n_experts, dtype=scores.dtype, device=scores.device).index_add_(0, seg, chosen)
    p_norm = scores / scores.sum(dim=-1, keepdim=True)
    p_sum = torch.zeros_like(counts).index_add_(0, seg, p_norm)  # [N, E]
    split = cp is not None and cp.size > 1
    if split:
        counts = cp.sum_counts(counts)  # global f (no gradient)
    t_b = counts.sum(dim=1) / K  # [N] tokens per segment: each token picks exactly K experts (exact below 2^24 / K)
    # a real segment holds >= 1 token; an empty one (the static padding of packing.pad_pack) adds 0, not 0/0
    per_seg = (counts * p_sum).sum(dim=1) * n_experts / (K * t_b * t_b).clamp_min(1e-30)  # CP: this rank's share of P
    if split:
        return cp.sum_partial(per_seg.sum()) / n_segments
    return per_seg.sum() / (t_b > 0).sum().clamp_min(1)  # the mean over real segments, counted on the device


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
    (``MoE`` runs its routed experts through :func:`run_local_experts` and applies the routing
    weight to the ``w2`` output instead: ``w2`` is linear, so the math is the same.)
    """

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.limit = swiglu_limit

    def activation(self, gate: torch.Tensor, up: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """:func:`swiglu` with this expert's limit: gate, up [n, inter] -> [n, inter] accumulation dtype, or
        ``out_dtype`` (the grouped path's GEMM operand dtype: the cast fused into the same kernel on CUDA).

        The region Megatron's selective recompute calls ``moe_act`` (``parallel/recompute.py``
        checkpoints this method); :func:`run_local_experts` calls the first local expert's for the
        grouped path (every expert of a layer has the same limit).
        """
        return swiglu(gate, up, self.limit, out_dtype)

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [n, dim], weights [n, 1] or None -> [n, dim] in x's dtype."""
        h = self.activation(linear(x, self.w1), linear(x, self.w3))
        if weights is not None:
            h = h * weights
        return linear(h.to(x.dtype), self.w2)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` in the accumulation dtype (L = 0: no clamp).

    gate, up [n, inter] (any float dtype) -> [n, inter] float32 (float64 for float64 input), rounded to
    ``out_dtype`` when given. On CUDA (``regions.fused_here``) one compiled region each way (model/regions.py):
    the eager chain wrote five float32 [n, inter] tensors per call (the upcasts, the clamps, silu, the product)
    and as many in the backward; at Flash width n is ~393K routed rows per layer.
    Source: upstream ``Expert.forward`` (spec §3 "Expert (SwiGLU with clamp)").
    """
    if regions.fused_here(gate):
        return regions.run(_swiglu, (0, 1), gate, up, float(limit), out_dtype)
    return _swiglu(gate, up, limit, out_dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    acc = acc_dtype(gate.dtype)
    gate, up = gate.to(acc), up.to(acc)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    h = F.silu(gate) * up
    return h if out_dtype is None else h.to(out_dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert matmuls run in: autocast's when it is on for x's device, else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def grouped_mm_applies(x: torch.Tensor, dim: int, inter_dim: int) -> bool:
    """True when :func:`run_local_experts` takes the grouped-GEMM path by default.

    That is bf16 compute (x's dtype or autocast's) on a CUDA device of compute capability
    >= 9.0 (Hopper's grouped GEMM kernel), with ``dim`` and ``inter_dim`` multiples of 8 (the
    kernel needs 16-byte aligned row strides). Everything else takes the per-expert loop.
    """
    if not x.is_cuda or _compute_dtype(x) != torch.bfloat16 or dim % 8 or inter_dim % 8:
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


def run_local_experts(experts: list[Expert], x: torch.Tensor, counts: torch.Tensor,
                      grouped: Optional[bool] = None, fp8: bool = False) -> torch.Tensor:
    """Unweighted SwiGLU outputs of rows grouped by expert: ``w2(swiglu(w1 x, w3 x))`` per row.

    Args:
        experts: the E_l experts, in the order of the row groups.
        x: [M, dim] rows; the first ``counts[0]`` go to ``experts[0]``, and so on.
        counts: [E_l] int64 rows per expert (on x's device; ``counts.sum() == M``).
        grouped: True = one ``torch._grouped_mm`` per weight over the stacked expert weights
            (on the CPU it needs float32/bf16 and 16-byte aligned rows); False = a loop of
            per-expert matmuls (reads ``counts`` on the host); None = :func:`grouped_mm_applies`.
        fp8: the grouped path's forward and input-gradient GEMMs in e4m3 with rowwise scales
            (``fp8_experts.fp8_expert_mlp``: w1 and w3 as one GEMM, the casts fused into the SwiGLU regions; the
            weight gradients bf16); the SwiGLU computes in float32.
            Set by ``parallel.precision.apply_fp8`` (``MoE.fp8_experts``) under an FP8 recipe. Ignored
            off the grouped path.
    Returns: [M, dim] in the compute dtype (x's, or autocast's). Every expert is part of
        the graph (zero rows included), so each one gets a gradient tensor; it is zero
        exactly when the expert got no rows.
    The grouped path never synchronises with the host: offsets = int32 cumsum of ``counts``.
    """
    if grouped is None:
        grouped = grouped_mm_applies(x, experts[0].w1.weight.shape[1], experts[0].w1.weight.shape[0])
    if not grouped:
        outs = [expert(rows) for expert, rows in zip(experts, x.split(counts.tolist()))]
        return torch.cat(outs) if outs else x
    dtype = _compute_dtype(x)

    def stacked(name: str) -> torch.Tensor:  # [E_l, out, in]
        return _stack_weights(experts, name, dtype)

    xc = x.to(dtype)
    if xc.shape[0] == 0:  # no rows reached these experts: the grouped GEMMs' weight gradients refuse zero rows
        zero = (xc.sum() + sum(getattr(e, k).weight.sum() for e in experts for k in ("w1", "w2", "w3"))) * 0
        return xc.new_zeros(0, experts[0].w2.weight.shape[0]) + zero.to(dtype)  # zero gradients, still in the graph
    if fp8:
        return fp8_experts.fp8_expert_mlp(xc, *fp8_weight_stacks(experts, dtype), counts, experts[0].limit)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E_l] end row of each expert's group
    h = experts[0].activation(torch._grouped_mm(xc, stacked("w1").mT, offs=offsets),
                              torch._grouped_mm(xc, stacked("w3").mT, offs=offsets), dtype)  # [M, inter] dtype
    return torch._grouped_mm(h, stacked("w2").mT, offs=offsets)


def fp8_weight_stacks(experts: list[Expert], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 MLP's weight operands (``fp8_experts``): (w13 [E_l, 2*inter, dim], each expert's w1 over its w3;
    w2 [E_l, dim, inter]) in ``dtype``, built with autograd (each expert's parameters get their slices' gradients)."""
    w1, w3, w2 = (_stack_weights(experts, name, dtype) for name in ("w1", "w3", "w2"))
    return torch.cat([w1, w3], dim=1), w2


def _stack_weights(experts: list[Expert], name: str, dtype: torch.dtype) -> torch.Tensor:
    """The experts' ``name`` weights as one [E_l, out, in] tensor in ``dtype`` (differentiable)."""
    return torch.stack([getattr(e, name).weight.to(dtype) for e in experts])


class Route(NamedTuple):
    """Token slots sorted by expert. A slot is one (token t, choice k) pair, numbered ``t * K + k``
    in token-major order; the sorted order groups slots by expert (stable: by token within one).

    order [T*K]: token-major slot at each sorted position. token_of [T*K]: its token (``order // K``).
    slot_to_sorted [T*K]: sorted position of each token-major slot (the inverse permutation).
    counts [E] int64: slots per expert (the group sizes of the sorted order).
    """

    order: torch.Tensor
    token_of: torch.Tensor
    slot_to_sorted: torch.Tensor
    counts: torch.Tensor


def route_slots(indices: torch.Tensor, n_experts: int) -> Route:
    """Sort the slots of ``indices`` [T, K] (expert ids) by expert; see :class:`Route`.

    No atomics and no host synchronisation: one stable sort, the counts by binary search of the
    expert boundaries in the sorted ids, the inverse permutation by a scatter of distinct rows.
    """
    T, K = indices.shape
    experts, order = indices.flatten().sort(stable=True)  # [T*K] each
    ends = torch.searchsorted(experts, torch.arange(n_experts, device=indices.device, dtype=experts.dtype), right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [E]
    slot_to_sorted = torch.empty_like(order).scatter_(0, order, torch.arange(T * K, device=order.device))
    return Route(order, order // K, slot_to_sorted, counts)


class _GatherRows(torch.autograd.Function):
    """``out = src[index]`` where every row of ``src`` is read exactly ``group`` times, so the
    gradient is a gather too: ``d src[r] = sum_g d out[adjoint[r * group + g]]``.

    For the expert dispatch (src = tokens [T, dim], index = token of each sorted slot,
    adjoint = sorted position of each token-major slot, group = K) and the combine (src = sorted
    slots, index = sorted position of each token-major slot, adjoint = the sort order,
    group = 1). Autograd's own backward of ``src[index]`` accumulates with atomics or a sort.
    """

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor, adjoint: torch.Tensor, group: int) -> torch.Tensor:
        ctx.save_for_backward(adjoint)
        ctx.group = group
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (adjoint,) = ctx.saved_tensors
        d = grad.index_select(0, adjoint)
        if ctx.group > 1:
            d = d.view(-1, ctx.group, *grad.shape[1:]).sum(1)
        return d, None, None, None


def gather_rows(x: torch.Tensor, token_of: torch.Tensor, slot_to_sorted: torch.Tensor, k: int) -> torch.Tensor:
    """Dispatch: x [T, dim] -> the token row of every sorted slot [T*K, dim] (``x[token_of]``).
    Backward: each token's gradient is the sum of its K slots' gradients, gathered (no atomics)."""
    return _GatherRows.apply(x, token_of, slot_to_sorted, k)


def combine_slots(ys: torch.Tensor, route: Route, weights: torch.Tensor) -> torch.Tensor:
    """Combine: expert outputs of the sorted slots ys [T*K, dim] -> ``y_t = sum_k w_tk ys[slot(t, k)]``.

    weights [T, K] routing weights (accumulation dtype) -> y [T, dim] in the weights' dtype. The
    slots are gathered back to token-major order (backward: a gather by the sort order), then
    weighted and summed per token: no scatter, no atomics. On CUDA the weighted sum is a compiled region
    (model/regions.py).
    """
    T, K = weights.shape
    slots = _GatherRows.apply(ys, route.slot_to_sorted, route.order, 1).view(T, K, -1)  # [T, K, dim] token-major
    if regions.fused_here(slots):  # one reduction kernel each way: eager wrote the [T, K, dim] float32 products
        return regions.run(_weighted_slot_sum, (0, 1), slots, weights)
    return _weighted_slot_sum(slots, weights)


def _weighted_slot_sum(slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """slots [T, K, dim] (compute dtype), weights [T, K] -> ``sum_k w_tk slots[t, k]`` [T, dim] in weights' dtype."""
    return (slots * weights[..., None]).sum(1)


class MoE(nn.Module):
    """Routed experts + one shared expert. x [T, dim] -> (y [T, dim], balance loss 0-d).

    ``experts``: ``ModuleDict`` of :class:`Expert` keyed by global expert id ("0" .. "E-1");
    under expert parallelism only this rank's ids remain (``parallel.apply_expert_parallel``).
    ``dispatcher``: the :class:`parallel.base.ExpertDispatch` moving rows to the rank of
    their expert (default: the single-device identity).

    Every local expert runs (possibly on zero rows) so each gets a gradient tensor every
    step. The routing weight is applied in the accumulation dtype to each routed expert's
    ``w2`` output (upstream applies it before ``w2``; ``w2`` is linear, so the math is the
    same). Expert token counts of forwards in training mode accumulate in ``expert_counts``
    [E] (non-persistent buffer; every rank counts its own tokens over ALL E experts) for
    :meth:`update_bias`.

    Host syncs on CUDA: none with the default dispatcher and the grouped-GEMM path; the
    expert-parallel dispatcher reads its all-to-all split sizes on the host once per forward;
    the per-expert loop (CPU, float32/float64) reads ``counts`` once.
    """

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts, self.topk = args.n_routed_experts, args.n_activated_experts
        self.gate = Gate(layer_id, args)
        self.experts = nn.ModuleDict({str(e): Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                                      for e in range(self.n_experts)})
        self.shared_experts = (Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                               if args.n_shared_experts else None)
        self.dispatcher: ExpertDispatch = SINGLE_DEVICE_EXPERTS
        self.register_buffer("expert_counts", torch.zeros(self.n_experts, dtype=torch.int64), persistent=False)
        self.fp8_experts = False  # the routed experts' grouped GEMMs in FP8 (set by parallel.precision.apply_fp8)
        # with fp8_experts under EP, where the grouped path runs (bf16 compute on SM90+): rows into the experts cross
        # the all-to-all as e4m3 (precision.fp8_dispatch)
        self.fp8_dispatch = False

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, seg: torch.Tensor,
                n_segments: int, cp=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (y [T, dim], balance loss); ``cp``: see :func:`sequence_balance_loss`."""
        weights, indices, scores = self.gate(x, token_ids)  # [T, K], [T, K], [T, E]
        route = route_slots(indices, self.n_experts)
        if self.training:
            self.expert_counts += route.counts
        xs = gather_rows(x.to(_compute_dtype(x)), route.token_of, route.slot_to_sorted, self.topk)  # [T*K, dim]
        experts = list(self.experts.values())
        w1 = experts[0].w1.weight
        if (self.fp8_experts and self.fp8_dispatch and self.dispatcher.ep > 1
                and grouped_mm_applies(xs, w1.shape[1], w1.shape[0])):  # e4m3 rows on the EP wire
            ys = self.dispatcher.fp8_experts(xs, route.counts, *fp8_weight_stacks(experts, xs.dtype),
                                             experts[0].limit)
        else:
            x_local, local_counts, ctx = self.dispatcher.dispatch(xs, route.counts)
            y_local = run_local_experts(experts, x_local, local_counts, fp8=self.fp8_experts)
            ys = self.dispatcher.combine(y_local, ctx)  # [T*K, dim], slots sorted by expert
        y = combine_slots(ys, route, weights)  # [T, dim] accumulation dtype
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
        if not self.gate.is_hash:  # no counts yet: err = 0 everywhere, sign 0, no change (no host read)
            load = self.expert_counts.to(torch.float64)
            err = load.mean() - load
            self.gate.bias += (speed * torch.sign(err)).to(self.gate.bias.dtype)
        self.expert_counts.zero_()
