"""Main attention of one layer: SWA, CSA (indexer top-k) or HCA, on a THD batch.

Spec: reference/v4-model-spec.md §2 (query path, shared KV latent, sliding window,
core attention with sink, inverse RoPE, grouped output projection) and §1 (per-layer
RoPE). Seed 000 §2 (phase graphs), §3 (gradient ownership), §4 (THD resets).
Seed 004 items 1 (scale head_dim**-0.5, no mscale), 3 (de-rotation before ``wo_a``
on every layer), 6b (detached teacher and indexer inputs), 11 (chunked KL target).
Upstream: ``Attention.forward`` in the released ``inference/model.py`` and the
``sparse_attn`` kernel in ``inference/kernel.py``.

Per query t (position p in its segment) the candidate keys are the window tokens
``max(0, p-W+1) .. p`` and compressed entries i < (p+1)//ratio (all of them for HCA
and dense-mode CSA, the indexer's top-k for CSA with an indexer). One softmax runs
over window + compressed logits ``(q . kv) * head_dim**-0.5`` with ``exp(attn_sink[h])``
added to the denominator; the output is ``sum p * kv`` (V = K). Queries are processed
in chunks of ``chunk_size`` rows, so no [T, T] or [T, H, all entries] tensor exists.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Literal, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .args import ModelArgs
from .common import FP32Pinned, RMSNorm, acc_dtype, linear, on_device_count, rms_unweighted
from .compressor import Compressor
from .indexer import Indexer, kl_teacher_student, select_topk
from .kernels.layer import attention_forward, gather_label
from .packing import CompressPlan, EntryMemory, Pack, compress_plan, entry_range, visible_table
from .parallel import SINGLE_DEVICE, ContextParallel, Shard
from .rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from .kernels.dispatch import Backend

KLTarget = Literal["visible", "selected"]


@dataclass
class BatchContext:
    """Tables shared by every layer of one forward (built once per batch).

    ``pack``: this rank's rows (every row on one device). ``kl_target``: "visible"
    (warm-up: dense teacher over all visible entries) or "selected" (sparse: teacher over
    the selected set). ``chunk_size``: query rows per chunk. ``cp``: context-parallel hooks
    (single-device no-op by default). ``shard``: the CP view of the batch
    (``cp.shard(...)``; on one device built from ``pack``: no boundary rows). ``kernels``:
    a fused backend from ``kernels.dispatch.select_backend`` (None: the reference path).
    ``recompute``: with autograd on and more than one query chunk, the reference path keeps
    only each chunk's output [R, H, D] and recomputes the chunk's gathered candidates
    [R, k, D], logits and probabilities [R, H, window + k] in backward, one chunk at a time:
    activation memory O(T * H * D) instead of O(T * (H + D) * (window + k)) (CSA at 64K
    tokens, V4-Flash shape: about 45 GB less). Costs one more chunk forward in backward.
    ``static``: the tables have static shapes (``V4Model.batch_context(static_seqlen=...)``, a step a CUDA graph
    replays): the kernel path's warm-up KL then reads nothing on the host (``kernels.layer.static_chunks``).
    """

    pack: Pack
    window: int
    kl_target: KLTarget = "selected"
    chunk_size: int = 256
    cp: ContextParallel = SINGLE_DEVICE
    shard: Optional[Shard] = None
    kernels: Optional["Backend"] = None  # fused attention kernels; None = the reference code below
    recompute: bool = True
    static: bool = False
    _plans: dict = field(default_factory=dict)
    _rope: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.shard is None:
            self.shard = Shard(pack=self.pack, ext=self.pack)

    @property
    def ext(self) -> Pack:
        """Rows attention reads as keys: ``shard.left`` boundary rows, then the local rows."""
        return self.shard.ext

    def plan(self, ratio: int, entries: Optional[int] = None) -> CompressPlan:
        """The compress plan of ``ratio`` (built on first use; ``entries``: the static entry count of a
        ``packing.pad_pack`` batch, one device only)."""
        if ratio not in self._plans:
            self._plans[ratio] = (self.cp.plan(self.shard, ratio) if entries is None
                                  else compress_plan(self.pack, ratio, entries))
        return self._plans[ratio]

    def load(self, other: "BatchContext") -> None:
        """Copy the tables of ``other`` (a batch of the same static shapes: ``V4Model.batch_context`` with the
        same ``static_seqlen`` and T) into this context's tensors, in place: a CUDA graph captured on this
        context then runs on ``other``'s batch. RoPE tables are dropped, not copied: the next forward builds
        them from the new ``pack.pos``, and a forward captured after a ``load`` records that build, so every
        replay rebuilds them.

        Raises:
            ValueError: the contexts differ in a shape, a host bound, the plans held or the phase.
        """
        pairs = [(self.pack, other.pack)] + [(self._plans.get(r), p) for r, p in other._plans.items()]
        if (self.kl_target != other.kl_target or set(self._plans) != set(other._plans)
                or self.shard.ext is not self.pack or other.shard.ext is not other.pack):
            raise ValueError("BatchContext.load: the contexts differ in phase, compress plans or sharding")
        for mine, theirs in pairs:
            for name, value in vars(theirs).items():
                held = getattr(mine, name)
                if isinstance(value, torch.Tensor):
                    if held.shape != value.shape or held.dtype != value.dtype:
                        raise ValueError(f"BatchContext.load: {type(mine).__name__}.{name} is "
                                         f"{tuple(value.shape)} {value.dtype}, the static one "
                                         f"{tuple(held.shape)} {held.dtype}: not the same static batch shape")
                    held.copy_(value, non_blocking=True)
                elif name != "cu_host" and held != value:
                    raise ValueError(f"BatchContext.load: {type(mine).__name__}.{name} = {value!r}, the static "
                                     f"one {held!r}: not the same static batch shape")
        self._rope.clear()  # eager use rebuilds them from the new positions; a capture after load records that

    def cached_keys(self) -> tuple[frozenset, frozenset]:
        """The keys of the compress plans and RoPE tables built so far (see :meth:`as_of`)."""
        return frozenset(self._plans), frozenset(self._rope)

    @contextlib.contextmanager
    def as_of(self, keys: tuple[frozenset, frozenset]) -> Iterator[None]:
        """The tables as they were when :meth:`cached_keys` gave ``keys``: those built since are hidden for the
        duration (and built again if needed) and put back after.

        A recompute replay of a layer (``parallel/recompute.py``) runs inside this, so it computes what the
        layer's forward computed: the first layer of each kind builds the tables in the forward and again in
        the replay. Under ``torch.compile`` the replay then takes the forward's graph, whose saved tensors
        the checkpoint matches one by one.
        """
        plans, ropes = self._plans, self._rope
        self._plans = {k: v for k, v in plans.items() if k in keys[0]}
        self._rope = {k: v for k, v in ropes.items() if k in keys[1]}
        try:
            yield
        finally:
            self._plans, self._rope = plans, ropes

    def cos_sin(self, rope: RotaryEmbedding, dtype: torch.dtype,
                extended: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables of the local rows, or of the extended rows with ``extended``."""
        pack = self.ext if extended else self.pack
        key = (rope.key, dtype, pack is self.pack)
        if key not in self._rope:
            self._rope[key] = rope.cos_sin(pack.pos, dtype)
        return self._rope[key]


def sink_softmax(logits: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax with a sink in the denominator: ``p = exp(l) / (sum exp(l) + exp(sink))``.

    logits [R, H, N] (already scaled), valid [R, N] bool, sink [H] (not scaled, no
    value vector) -> p [R, H, N], 0 where invalid. Source: ``sparse_attn`` kernel; spec §2.
    """
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    s = sink[None, :, None]  # [1, H, 1]
    m = torch.maximum(logits.amax(dim=-1, keepdim=True), s).detach()
    e = (logits - m).exp()
    return e / (e.sum(dim=-1, keepdim=True) + (s - m).exp())


class Attention(FP32Pinned):
    """One layer's attention. x [T, dim] -> ([T, dim], indexer KL or None).

    Parameters (released names and shapes): ``wq_a`` [q_lora_rank, dim], ``q_norm``,
    ``wq_b`` [H*D, q_lora_rank], ``wkv`` [D, dim], ``kv_norm``, ``wo_a``
    [o_groups*o_lora_rank, H*D/o_groups], ``wo_b`` [dim, o_groups*o_lora_rank],
    ``attn_sink`` [H] (FP32-pinned), ``compressor.*`` (ratio 4/128),
    ``indexer.*`` (ratio 4, only when built).
    """

    _fp32_names = ("attn_sink",)

    def __init__(self, layer_id: int, args: ModelArgs, with_indexer: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.ratio = args.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.rope_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.n_groups, self.o_lora_rank, self.eps = args.o_groups, args.o_lora_rank, args.norm_eps
        self.window_size, self.topk = args.window_size, args.index_topk
        self.softmax_scale = self.head_dim ** -0.5  # no YaRN mscale (seed 004 item 1)
        H, D = self.n_heads, self.head_dim
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, H * D, bias=False)
        self.wkv = nn.Linear(args.dim, D, bias=False)
        self.kv_norm = RMSNorm(D, args.norm_eps)
        self.wo_a = nn.Linear(H * D // self.n_groups, self.n_groups * self.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.n_groups * self.o_lora_rank, args.dim, bias=False)
        self.rope = RotaryEmbedding(args, self.ratio)
        if self.ratio:
            self.compressor = Compressor(args.dim, D, self.ratio, args.norm_eps)
            self.indexer = Indexer(args) if (self.ratio == 4 and with_indexer) else None

    @property
    def has_indexer(self) -> bool:
        return getattr(self, "indexer", None) is not None

    def forward(self, x: torch.Tensor, ctx: BatchContext) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [T, dim] (after mHC pre-mixing and attn_norm) -> (out [T, dim], KL 0-d or None).

        The KL is None without an indexer; with one it is the mean over queries that
        have at least one candidate (an explicit zero when the batch has no entry).
        """
        if ctx.kernels is not None:  # one dispatch point for the fused kernels (docs/kernels.md)
            return attention_forward(self, x, ctx, ctx.kernels)
        T, H, D = x.shape[0], self.n_heads, self.head_dim  # T: this rank's rows
        acc = acc_dtype(x.dtype)
        cos, sin = ctx.cos_sin(self.rope, x.dtype)  # [T, rd/2]
        xe = ctx.cp.extend(x, ctx.shard)  # [B + T, dim]: left boundary rows (CP only), then x
        cos_e, sin_e = ctx.cos_sin(self.rope, x.dtype, extended=True)
        qr = self.q_norm(linear(x, self.wq_a))  # [T, q_lora_rank]
        q = self.project_query(qr, cos, sin)  # [T, H, D]
        kv = apply_rope(self.kv_norm(linear(xe, self.wkv)), cos_e, sin_e).to(acc)  # [B + T, D]
        plan = comp = inp = None
        mems: list[EntryMemory] = []
        if self.ratio:
            plan = ctx.plan(self.ratio)
            if plan.n_entries and plan.max_entries:  # global counts: the same branch on every CP rank
                parts = [self.compressor(xe, plan, self.rope)]  # [C_own, D]
                if self.has_indexer:
                    inp = self.indexer.prepare(x, qr, ctx.pack.pos, plan, self.rope, x_comp=xe)
                    parts.append(inp.keys)
                mems = ctx.cp.gather(parts, plan, ctx.shard, gather_label(ctx.cp, self.layer_id))
                comp = EntryMemory(mems[0].buf.to(acc), mems[0].phys)  # all entries, by logical id
                if inp is not None:
                    inp.keys = mems[1]
                    inp.split_rows(ctx.chunk_size)
        outs, kl_sum, kl_rows = [], None, 0
        attend = self._attend_chunk
        if ctx.recompute and torch.is_grad_enabled() and T > ctx.chunk_size:
            attend = functools.partial(checkpoint, self._attend_chunk, use_reentrant=False)
        # split, not q[rows]: a slice's backward zero-fills a whole [T, H, D] gradient per chunk
        # (O(T^2 * H * D / chunk) memory traffic, seconds at 128K); split joins the chunks once
        for start, q_rows in zip(range(0, T, ctx.chunk_size), q.split(ctx.chunk_size)):
            rows = slice(start, min(start + ctx.chunk_size, T))
            o_rows, part, n = attend(ctx, rows, q_rows.to(acc), kv, plan, comp, inp)
            outs.append(o_rows)
            if part is not None:
                kl_sum, kl_rows = (part if kl_sum is None else kl_sum + part), kl_rows + n
        o = apply_rope(torch.cat(outs).to(x.dtype), cos, sin, inverse=True)  # [T, H, D], de-rotated at t
        o = o.view(T, self.n_groups, H * D // self.n_groups)  # [T, G, H*D/G]: whole heads where G divides H
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)  # [G, o_lora_rank, H/G * D]
        o = torch.einsum("tgd,grd->tgr", o, wo_a.to(o.dtype)).flatten(1)  # [T, G * o_lora_rank]
        out = ctx.cp.tie(linear(o, self.wo_b), mems)
        if not self.has_indexer:
            return out, None
        if kl_sum is None:  # no compressed entry for these queries: an explicit zero
            kl_sum = sum(p.sum() for p in self.indexer.parameters()) * 0.0
        kl_sum = ctx.cp.tie(kl_sum, mems)
        kl_rows = ctx.cp.sum_counts(on_device_count(kl_rows, out.device))  # a device count: no host sync
        return out, ctx.cp.sum_partial(kl_sum) / kl_rows.clamp_min(1)

    def project_query(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Query up-projection, per-head RMS norm and RoPE: qr [T, q_lora_rank] -> q [T, H, D].

        Spec §2 query path steps 2-4. The region Megatron's selective recompute calls
        ``mla_up_proj`` (``parallel/recompute.py`` checkpoints this method); it holds no collective.
        """
        q = rms_unweighted(linear(qr, self.wq_b).unflatten(-1, (self.n_heads, self.head_dim)), self.eps)
        return apply_rope(q, cos, sin)

    def _attend_chunk(self, ctx: BatchContext, rows: slice, q_rows: torch.Tensor, kv: torch.Tensor,
                      plan: Optional[CompressPlan], comp: Optional[EntryMemory], inp):
        """One query chunk: local rows ``rows``, q_rows [R, H, D] -> (o [R, H, D], KL sum or None, KL rows).

        ``kv`` [B + T, D] and the pack tables use extended rows (``rows`` shifted by the B
        boundary rows); entry ids are global logical ids, lowered to physical rows by ``comp``.
        """
        scale = self.softmax_scale
        B = ctx.shard.left
        erows = slice(rows.start + B, rows.stop + B)  # the same queries in extended coordinates
        band, b_valid = _window_band(ctx.ext, erows, self.window_size)
        kv_band = kv[band]  # [Nb, D], a contiguous slice: one GEMM, no gather
        logits, valid = [torch.einsum("rhd,nd->rhn", q_rows, kv_band) * scale], [b_valid]  # [R, H, Nb]
        lo, hi = entry_range(ctx.ext, plan, erows) if comp is not None else (0, 0)
        if hi > lo:  # some query of the chunk sees a compressed entry
            vis_idx, vis_valid = visible_table(ctx.ext, plan, erows)  # [R, P] global entry ids
            vis_rel = (vis_idx - lo) * vis_valid  # ids relative to lo
            if inp is not None:  # CSA with indexer: the top-k selected entries
                c_idx, c_valid = select_topk(inp, vis_rel, vis_valid, rows, self.topk, lo, hi)  # [R, k]
                c_keys = comp.at(c_idx + lo)  # [R, k, D]: logical ids lowered to physical rows
                logits.append(torch.einsum("rhd,rkd->rhk", q_rows, c_keys) * scale)
                valid.append(c_valid)
            else:  # HCA, or CSA in dense mode: every visible entry
                c_keys = comp.rows(lo, hi)  # [Nc, D]
                logits.append(torch.einsum("rhd,cd->rhc", q_rows, c_keys) * scale)
                valid.append(_range_mask(ctx.ext, plan, erows, lo, hi))
        p = sink_softmax(torch.cat(logits, -1), torch.cat(valid, -1), self.attn_sink.to(q_rows.dtype))
        nb = kv_band.shape[0]
        o_rows = torch.einsum("rhn,nd->rhd", p[..., :nb], kv_band)  # [R, H, D]
        if hi <= lo:
            return o_rows, None, 0
        eq = "rhk,rkd->rhd" if c_keys.dim() == 3 else "rhc,cd->rhd"
        o_rows = o_rows + torch.einsum(eq, p[..., nb:], c_keys)
        if inp is None:
            return o_rows, None, 0
        part, n = self._kl_chunk(ctx, inp, rows, q_rows, comp, logits[1], c_idx, c_valid,
                                 vis_rel, vis_valid, lo, hi)
        return o_rows, part, n

    def _kl_chunk(self, ctx: BatchContext, inp, rows: slice, q_rows: torch.Tensor, comp: EntryMemory,
                  sel_logits: torch.Tensor, c_idx, c_valid, vis_rel, vis_valid, lo: int,
                  hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KL(teacher || indexer) summed over the chunk's rows (seed 000 §3; seed 004 items 6b, 11).

        comp: all entries by logical id; ids in c_idx / vis_rel are relative to lo.
        """
        if ctx.kl_target == "selected":
            student = Indexer.score_at(inp, rows, c_idx + lo)  # [R, k]
            return kl_teacher_student(sel_logits, student, c_valid)  # teacher: main logits at the selection
        with torch.no_grad():
            full = torch.einsum("rhd,cd->rhc", q_rows, comp.rows(lo, hi)) * self.softmax_scale  # [R, H, Nc]
            H, P = full.shape[1], vis_rel.shape[1]
            teacher = full.gather(2, vis_rel[:, None, :].expand(-1, H, P))  # [R, H, P]
        student = Indexer.score_all(inp, rows, lo, hi).gather(1, vis_rel)  # [R, P]
        return kl_teacher_student(teacher, student, vis_valid)


def _window_band(pack: Pack, rows: slice, window: int) -> tuple[slice, torch.Tensor]:
    """Keys of a query chunk's windows as one contiguous band of tokens.

    Returns (band slice of token ids, valid [R, Nb]): key j is valid for query t iff
    t - window < j <= t and j is in t's segment (spec §2 "Sliding window").
    """
    b0 = max(0, rows.start - window + 1)
    t = torch.arange(rows.start, rows.stop, device=pack.pos.device)[:, None]  # [R, 1]
    j = torch.arange(b0, rows.stop, device=pack.pos.device)[None, :]  # [1, Nb]
    seg_start = t - pack.pos[rows, None]
    return slice(b0, rows.stop), (j <= t) & (j > t - window) & (j >= seg_start)


def _range_mask(pack: Pack, plan: CompressPlan, rows: slice, lo: int, hi: int) -> torch.Tensor:
    """[R, hi - lo] bool: entry lo + c is visible to the row (own segment, i < (pos+1)//ratio)."""
    c = torch.arange(lo, hi, device=pack.pos.device)[None, :]
    first = plan.seg_offset[pack.seg[rows]][:, None]
    return (c >= first) & (c < first + plan.n_visible[rows, None])
