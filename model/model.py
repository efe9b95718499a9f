"""The whole V4 model: embed -> mHC streams -> blocks -> hc_head -> norm -> head, plus MTP.

Spec: reference/v4-model-spec.md §2–3; seed 000 §2 (phases), §3 (gradient ownership),
§4 (THD). Upstream: ``Block``, ``ParallelHead``, ``MTPBlock`` and ``Transformer`` in the
released ``inference/model.py`` (training forward over a packed batch instead of a
KV-cache decode).

Auxiliary losses (``ModelOutput.aux_losses``; raw values, the job scales and sums):
see :data:`AUX_LOSS_DOC`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence, get_args

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .attention import Attention, BatchContext
from .common import FP32Pinned, RMSNorm, acc_dtype, linear
from .indexer import Indexer
from .kernels.dispatch import BACKEND_NAMES, Backend, select_backend
from .loss import HeadLogits
from .mhc import hc_head, hc_post, hc_pre
from .moe import MoE
from .mtp import MTPBlock
from .packing import check_ids, pad_pack, shift_in_segment
from .parallel import SINGLE_DEVICE, ContextParallel, Shard

Phase = Literal["dense", "warmup", "sparse"]
"""dense: no indexer, CSA attends every visible compressed entry. warmup: indexer built,
sparse (top-k) main attention, KL teacher over ALL visible entries. sparse: KL teacher
over the selected set. Phases only move forward (seed 000 §2)."""
_PHASES: tuple[str, ...] = get_args(Phase)

AUX_LOSS_DOC = {
    "indexer_kl/layer_NN": "KL(teacher || indexer) per CSA layer NN (zero-padded layer id; MTP layers use "
                           "n_layers + k - 1), mean over queries with >= 1 candidate. Present only when the "
                           "model has indexers (phase warmup/sparse). Gradient reaches indexer.* only.",
    "balance/layer_NN": "DeepSeek-V3 sequence-wise balance loss sum_i f_i P_i WITHOUT alpha, per packed "
                        "segment then averaged; 1.0 when perfectly balanced, E/K when collapsed. Every MoE "
                        "layer, hash layers and MTP layers included.",
    "mtp/depth_K": "MTP cross entropy at depth K (1-based), mean over tokens whose target exists, unweighted.",
}


@dataclass
class ModelOutput:
    """Result of :meth:`V4Model.forward`.

    lm_loss: 0-d mean token cross entropy over labels != -100 (None without labels).
    aux_losses: name -> 0-d raw auxiliary loss (names in :data:`AUX_LOSS_DOC`).
    logits: [T, vocab] float32 (float64 for a float64 model), only with return_logits=True.
    """

    lm_loss: Optional[torch.Tensor]
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    logits: Optional[torch.Tensor] = None


_HC = ("hc_attn_fn", "hc_ffn_fn", "hc_attn_base", "hc_ffn_base", "hc_attn_scale", "hc_ffn_scale")


class Block(FP32Pinned):
    """Decoder layer: mHC-wrapped attention then MoE. Streams [T, hc, dim] -> same.

    Parameters: ``attn.*``, ``ffn.*``, ``attn_norm``, ``ffn_norm``, ``hc_{attn,ffn}_fn``
    [(2+hc)*hc, hc*dim], ``_base`` [(2+hc)*hc], ``_scale`` [3] (all hc_* FP32-pinned).
    """

    _fp32_names = _HC

    def __init__(self, layer_id: int, args: ModelArgs, with_indexer: bool) -> None:
        super().__init__()
        self.layer_id, self.args = layer_id, args
        self.attn = Attention(layer_id, args, with_indexer)
        self.ffn = MoE(layer_id, args)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        n_mix, hc_dim = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", nn.Parameter(torch.zeros(n_mix, hc_dim, dtype=torch.float32)))
            setattr(self, f"hc_{sub}_base", nn.Parameter(torch.zeros(n_mix, dtype=torch.float32)))
            setattr(self, f"hc_{sub}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _mix(self, h: torch.Tensor, sub: str):
        a = self.args
        return hc_pre(h, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                      getattr(self, f"hc_{sub}_base"), a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor, ctx: BatchContext):
        """h [T, hc, dim] -> (h [T, hc, dim], indexer KL or None, balance loss)."""
        x, post, comb = self._mix(h, "attn")
        a, kl = self.attn(self.attn_norm(x), ctx)
        h = hc_post(a, h, post, comb)
        x, post, comb = self._mix(h, "ffn")
        f, bal = self.ffn(self.ffn_norm(x), token_ids, ctx.pack.seg, ctx.pack.n_segments, ctx.cp)
        return hc_post(f, h, post, comb), kl, bal


class MTPLayer(Block, MTPBlock):
    """MTP layer ``mtp.k``: a full Block (layer id n_layers + k) plus the MTP projections/head mixing."""

    _fp32_names = _HC + MTPBlock._mtp_fp32

    def __init__(self, layer_id: int, args: ModelArgs, with_indexer: bool) -> None:
        super().__init__(layer_id, args, with_indexer)
        self._init_mtp(args)


class LayerDict(nn.ModuleDict):
    """Decoder layers keyed by ``str(layer_id)`` (state-dict keys ``layers.N.*`` as in a list).

    A pipeline stage keeps only its own layers, so the ids need not be contiguous;
    ``layers[3]`` and ``layers["3"]`` both name layer 3.
    """

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key))


class V4Model(FP32Pinned):
    """DeepSeek-V4 model for training on packed (THD) batches.

    Args:
        args: architecture. phase: "dense" | "warmup" | "sparse" (see :data:`Phase`).
        chunk_size: query rows per attention / indexer chunk (memory is linear in it).
        recompute: the reference attention keeps only each chunk's output for backward and
            recomputes the chunk's candidates, logits and probabilities there
            (``BatchContext.recompute``); False keeps them (faster, O(T * (window + k) * D) bytes).
        cp: context-parallel hooks; the default is the single-device no-op. With
            ``parallel.ContextParallelGroup(group)`` each rank passes its contiguous slice
            of tokens/labels and the GLOBAL cu_seqlens, and every loss is the global
            value (docs/context_parallel.md).
        kernel_backend: attention kernels, the recipe's ``attention.kernel_backend``:
            "reference" (plain PyTorch, any device), "triton" (fused kernels on SM90; on any
            other device the reference path runs and :attr:`kernel_backend_reason` says why),
            "cudnn" (FlashMLA + cuDNN DSA, not shipped: the first forward raises
            ``kernels.BackendUnavailable``). Resolved per device on the first forward
            (docs/kernels.md).
    Raises:
        ValueError: unknown phase or kernel backend name.

    Parameter names and shapes follow the released checkpoint after ``convert.py``
    (``embed.weight``, ``layers.N.*``, ``norm.weight``, ``head.weight``, ``hc_head_*``,
    ``mtp.K.*``). ``layers`` is a :class:`LayerDict`; a pipeline stage (``model/parallel/
    pipeline.py``) is this model with the layers and top-level modules it does not run removed
    (``None``), and calls the forward pieces :meth:`batch_context`, :meth:`embed_streams`,
    :meth:`run_layers` and :meth:`head_losses` that :meth:`forward` composes. Weights are drawn from the global RNG (normal(0, init_std) for
    matrices, ones for norms and hc scales, zeros for sinks, ``ape``, hc bases and router
    biases); indexers are drawn from a generator seeded by ``args.seed`` and the layer id,
    so every rank builds identical indexers in :meth:`set_phase`.
    """

    _fp32_names = ("hc_head_fn", "hc_head_base", "hc_head_scale")

    def __init__(self, args: ModelArgs, phase: Phase = "dense", *, chunk_size: int = 256,
                 cp: Optional[ContextParallel] = None, kernel_backend: str = "reference",
                 recompute: bool = True) -> None:
        super().__init__()
        _check_phase(phase)
        self._backends: dict[str, Backend] = {}
        self.set_kernel_backend(kernel_backend)
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size}: must be >= 1. Fix: pass a positive number of query rows.")
        self.args, self.phase, self.chunk_size, self.cp = args, phase, chunk_size, cp or SINGLE_DEVICE
        self.recompute = recompute
        with_indexer = phase != "dense"
        d, hc = args.dim, args.hc_mult
        self.embed = nn.Embedding(args.vocab_size, d)
        self.layers = LayerDict({str(i): Block(i, args, with_indexer) for i in range(args.n_layers)})
        self.norm = RMSNorm(d, args.norm_eps)
        self.head = nn.Linear(d, args.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(args.n_layers + k, args, with_indexer) for k in range(args.n_mtp_layers))
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.reset_parameters()

    # ----------------------------------------------------------------- set-up
    def _blocks(self) -> list[Block]:
        return list(self.layers.values()) + list(self.mtp or ())

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every parameter (indexers from their seeded generators)."""
        for name, p in self.named_parameters():
            if ".indexer." in name:
                continue
            _init_param(name, p, self.args.init_std, None)
        for block in self._blocks():
            if block.attn.has_indexer:
                self._init_indexer(block)

    @torch.no_grad()
    def _init_indexer(self, block: Block) -> None:
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + 7919 * (block.layer_id + 1))
        for name, p in block.attn.indexer.named_parameters():
            _init_param(name, p, self.args.init_std, g)

    @property
    def has_indexer(self) -> bool:
        """True when CSA layers carry an indexer (phase warmup or sparse)."""
        return any(b.attn.has_indexer for b in self._blocks())

    def set_phase(self, phase: Phase) -> None:
        """Move to a later phase. Leaving "dense" builds and initialises indexers on every
        CSA layer (on the layer's device, in its parameter dtype: its norm's, which storage never lowers,
        where a GEMM weight may be stored in bf16 by the seam; rebuild the optimizer afterwards).

        Raises:
            ValueError: unknown phase name, or a move backwards (e.g. sparse -> warmup).
        """
        _check_phase(phase)
        if _PHASES.index(phase) < _PHASES.index(self.phase):
            raise ValueError(f"phase={phase!r}: the model is in phase {self.phase!r} and phases only move forward "
                             f"({' -> '.join(_PHASES)}). Fix: build a new V4Model (or load a checkpoint) to go back.")
        if self.phase == "dense" and phase != "dense":
            for block in self._blocks():
                attn = block.attn
                if attn.ratio == 4:
                    ref = block.attn_norm.weight  # the model's dtype (parallel/storage.py lowers only GEMM weights)
                    attn.indexer = Indexer(self.args).to(device=ref.device, dtype=ref.dtype)
                    self._init_indexer(block)
        self.phase = phase

    # ---------------------------------------------------------------- forward
    def set_kernel_backend(self, name: str) -> None:
        """Switch the attention kernels (e.g. per curriculum stage); resolved again on the next forward.

        Raises:
            ValueError: ``name`` is not one of ``kernels.BACKEND_NAMES``.
        """
        if name not in BACKEND_NAMES:
            raise ValueError(f"kernel_backend={name!r}: must be one of {BACKEND_NAMES}. "
                             "Fix: use the recipe's attention.kernel_backend values.")
        self.kernel_backend = name
        self._backends.clear()

    def kernels_for(self, device: torch.device | str) -> Backend:
        """The backend ``device`` runs for :attr:`kernel_backend` (cached per device).

        Raises:
            kernels.BackendUnavailable: the backend cannot run here (cudnn is not shipped).
        """
        key = str(device)
        if key not in self._backends:
            self._backends[key] = select_backend(self.kernel_backend, torch.device(device))
        return self._backends[key]

    def _kernels(self, device: torch.device) -> Optional[Backend]:
        """The fused backend for ``device``, or None for the reference path in attention.py."""
        if self.kernel_backend == "reference":
            return None
        backend = self.kernels_for(device)
        return None if backend.name == "reference" else backend

    @property
    def kernel_backend_reason(self) -> str:
        """Why each device runs the backend it runs (empty before the first forward)."""
        return "; ".join(f"{dev}: {b.name} ({b.reason})" for dev, b in self._backends.items())

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                labels: Optional[torch.Tensor] = None, return_logits: bool = False, *,
                ids_checked: bool = False) -> ModelOutput:
        """Packed forward: :meth:`embed_streams` -> :meth:`run_layers` -> :meth:`head_losses`.

        Args:
            tokens: [T] int64 token ids (THD, no batch dim); under CP this rank's L rows.
            cu_seqlens: [N+1] int32/int64 segment boundaries, 0 first, T last (global under CP).
            max_seqlen: int >= the longest segment.
            labels: [T] int64 next-token targets, -100 = ignore (None: no losses).
            return_logits: also return the main-model logits [T, vocab].
            ids_checked: the caller range-checked ``tokens`` and ``labels`` on the host (:meth:`batch_context`).
        Returns: :class:`ModelOutput` (under CP: local logits, global losses).
        Raises: ValueError on malformed tokens / cu_seqlens / max_seqlen / labels, and under
            CP when cu_seqlens[-1] != cp * L or L < the boundary width.
        """
        ctx = self.batch_context(tokens, cu_seqlens, max_seqlen, labels, ids_checked=ids_checked)
        return self.forward_in(ctx, tokens, labels, return_logits)

    def forward_in(self, ctx: BatchContext, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                   return_logits: bool = False) -> ModelOutput:
        """The forward on tables already built by :meth:`batch_context` (no host synchronisation when the
        kernels are sync-free: what a captured CUDA graph runs). Arguments and result as :meth:`forward`."""
        aux: dict[str, torch.Tensor] = {}
        h, e_mtp = self.embed_streams(tokens, ctx, with_mtp=labels is not None)
        h = self.run_layers(h, tokens, ctx, aux)
        lm_loss, logits = self.head_losses(h, e_mtp, tokens, labels, ctx, aux)
        return ModelOutput(lm_loss=lm_loss, aux_losses=aux, logits=logits.materialize() if return_logits else None)

    def _logits(self, hidden: torch.Tensor) -> HeadLogits:
        """The head on ``hidden`` [T, dim], lazily: ``_ce`` fuses it with the loss in row chunks
        (no [T, vocab] product; the row passes on the fused backend's kernels when there is one);
        ``.materialize()`` gives the logits [T, vocab] (acc dtype)."""
        return HeadLogits(hidden, self.head.weight, self._kernels(hidden.device))

    def batch_context(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                      labels: Optional[torch.Tensor] = None, *, static_seqlen: Optional[int] = None,
                      ids_checked: bool = False) -> BatchContext:
        """Check a packed batch (arguments as in :meth:`forward`) and build the tables every layer reads.

        ``static_seqlen``: tables whose shapes depend only on T and this bound on any segment's length
        (``packing.pad_pack``: T segment rows, ``max_seqlen = static_seqlen``, ``T // ratio`` compressed
        entries per ratio), so that a step captured in a CUDA graph on one batch replays on any other batch
        of T tokens after :meth:`BatchContext.load`. The losses and gradients are those of the exact tables
        (tests/model/test_static_batch.py). One device only.
        ``ids_checked``: the caller range-checked tokens and labels on the host already (``packing.check_ids``
        on the CPU tensors before their copy; the training job's batches). The check here is skipped: on a GPU
        it reads the device back, which waits for every kernel queued before it, so the host could not build
        the next step's tables while the GPU still runs the previous step.

        Raises: ValueError as :meth:`forward`; a segment longer than ``static_seqlen``; ``static_seqlen``
            under context parallelism.
        """
        if static_seqlen is not None and self.cp.size > 1:
            raise ValueError(f"static_seqlen={static_seqlen}: static batch tables are for one device, "
                             f"not context parallelism (cp={self.cp.size}). Fix: leave static_seqlen unset")
        shard = self.cp.shard(tokens, cu_seqlens, max_seqlen if static_seqlen is None else static_seqlen,
                              self.args.window_size, self.args.compress_ratios)
        if not ids_checked:
            check_ids(tokens, labels, self.args.vocab_size)
        if static_seqlen is not None:
            pack = pad_pack(shard.pack, tokens.numel(), static_seqlen)
            shard = Shard(pack=pack, ext=pack)
        for block in self._blocks():  # RoPE tables on the device before any compiled region reads them
            block.attn.rope.inv_freq_on(tokens.device)
        ctx = BatchContext(shard.pack, self.args.window_size, "visible" if self.phase == "warmup" else "selected",
                           self.chunk_size, self.cp, shard, kernels=self._kernels(tokens.device),
                           recompute=self.recompute, static=static_seqlen is not None)
        # The compress plans here, outside any compiled region: built inside a compiled block, their entry count
        # (a sum over the pack's host boundaries) guarded the block's graph on the number of documents, and every
        # new count recompiled it (a product batch packs a different number of documents each step).
        for ratio in sorted({r for r in self.args.compress_ratios if r}):
            ctx.plan(ratio, entries=None if static_seqlen is None else tokens.numel() // ratio)
        return ctx

    def embed_streams(self, tokens: torch.Tensor, ctx: BatchContext,
                      with_mtp: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """First pipeline piece: tokens [T] -> (streams h [T, hc, dim], MTP embeddings or None).

        The MTP embeddings [depth, T, dim] are ``embed(tok_k)`` of the tokens shifted k places
        inside their segment (:meth:`mtp_shifts`), for k = 1..depth; None without MTP layers
        or when ``with_mtp`` is False (no labels: no MTP losses).
        """
        h = self.embed(tokens)  # [T, dim]
        h = h.unsqueeze(1).repeat(1, self.args.hc_mult, 1)  # [T, hc, dim]
        if not with_mtp or not self.args.n_mtp_layers:
            return h, None
        shifted = self.mtp_shifts(tokens, 0, ctx)
        return h, torch.stack([self.embed(tok) for tok in shifted])  # [depth, T, dim]

    def run_layers(self, h: torch.Tensor, tokens: torch.Tensor, ctx: BatchContext, aux: dict,
                   layer_ids: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Decoder layers ``layer_ids`` (default: every layer this model holds, in order): h [T, hc, dim] -> same.

        Each layer's raw indexer KL and balance loss go into ``aux`` (names in :data:`AUX_LOSS_DOC`).
        Raises: KeyError when a layer id is not held here.
        """
        blocks = self.layers.values() if layer_ids is None else [self.layers[i] for i in layer_ids]
        for block in blocks:
            h, kl, bal = block(h, tokens, ctx)
            _record(aux, block.layer_id, kl, bal)
        return h

    def head_losses(self, h: torch.Tensor, e_mtp: Optional[torch.Tensor], tokens: torch.Tensor,
                    labels: Optional[torch.Tensor], ctx: BatchContext,
                    aux: dict) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """Last pipeline piece: hc_head + norm + head + LM loss, then the MTP layers and their losses.

        Args:
            h: [T, hc, dim] streams after the last decoder layer.
            e_mtp: [depth, T, dim] from :meth:`embed_streams` (None: no MTP losses).
            tokens, labels: [T] as in :meth:`forward` (labels None: no losses).
            aux: receives ``mtp/depth_K`` and the MTP layers' indexer KL / balance losses.
        Returns: (lm_loss 0-d or None without labels, logits [T, vocab]).
        """
        a = self.args
        hidden = self.norm(hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, a.hc_eps, a.norm_eps))
        logits = self._logits(hidden)  # [T, vocab]
        if labels is None:
            return None, logits
        lm_loss = _ce(logits, labels, self.cp)
        if e_mtp is not None:
            self._mtp(h, e_mtp, tokens, labels, ctx, aux)
        return lm_loss, logits

    def mtp_shifts(self, x: torch.Tensor, fill: int, ctx: BatchContext) -> list[torch.Tensor]:
        """``x`` [T] shifted k = 1..depth places left inside each segment (``fill`` past its end).

        Under CP the row after a rank's last row comes from its right neighbour
        (``cp.next_first``), the same contiguous convention as the labels (seed 000 §12 item 8).
        """
        out = []
        for _ in range(self.args.n_mtp_layers):
            x = shift_in_segment(x, ctx.pack, fill, self.cp.next_first(x, fill))
            out.append(x)
        return out

    def _mtp(self, h: torch.Tensor, e_mtp: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
             ctx: BatchContext, aux: dict) -> None:
        """MTP depths: depth k reads token t+k (embedding ``e_mtp[k-1]``) and predicts labels[t+k] (= token t+k+1)."""
        toks, labs = self.mtp_shifts(tokens, 0, ctx), self.mtp_shifts(labels, -100, ctx)
        for k, layer in enumerate(self.mtp, start=1):
            x = layer.mtp_input(h, e_mtp[k - 1])  # [T, hc, dim]
            h, kl, bal = layer(x, toks[k - 1], ctx)
            _record(aux, layer.layer_id, kl, bal)
            aux[f"mtp/depth_{k}"] = _ce(self._logits(layer.mtp_hidden(h, self.args.hc_eps, self.args.norm_eps)),
                                        labs[k - 1], self.cp)

    @torch.no_grad()
    def update_router_bias(self, speed: float) -> None:
        """Aux-loss-free balancing step on every learned router (main and MTP layers).

        Uses the expert token counts accumulated by forwards in training mode since the
        previous call, ``bias += speed * sign(mean_load - load)``, then clears the counts.
        No gradient, no optimizer. ``speed`` is gamma (released recipe: 1e-3).
        """
        for block in self._blocks():
            block.ffn.update_bias(speed)


def _check_phase(phase: object) -> None:
    if phase not in _PHASES:
        raise ValueError(f"phase={phase!r}: must be one of {_PHASES}. Fix: start with 'dense' and move forward "
                         "with set_phase('warmup') then set_phase('sparse').")


def _record(aux: dict, layer_id: int, kl: Optional[torch.Tensor], bal: torch.Tensor) -> None:
    if kl is not None:
        aux[f"indexer_kl/layer_{layer_id:02d}"] = kl
    aux[f"balance/layer_{layer_id:02d}"] = bal


def _ce(logits: HeadLogits | torch.Tensor, labels: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Mean cross entropy over labels != -100 (0 with a graph when none is valid).

    ``logits``: the lazy head (chunked fused head + loss, ``loss.head_cross_entropy``) or a
    [T, vocab] tensor. Under CP: the sum over every rank's rows divided by the global count
    (replicated). The count stays on the device (``cp.sum_counts``): no host synchronisation."""
    n = cp.sum_counts((labels != -100).sum())
    if isinstance(logits, HeadLogits):
        total = cp.sum_partial(logits.cross_entropy(labels))
    else:
        total = cp.sum_partial(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
    return total / n.clamp_min(1)


def _init_param(name: str, p: torch.Tensor, std: float, gen: Optional[torch.Generator]) -> None:
    if p.is_meta:  # shape-only model (e.g. checking a full-size layout): nothing to draw
        return
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm." in name and leaf == "weight"
    if is_norm or leaf.endswith("_scale"):
        p.fill_(1.0)
    elif leaf in ("attn_sink", "ape") or leaf.endswith("_base"):
        p.zero_()
    elif gen is None:
        p.normal_(0.0, std)
    else:  # seeded draw on the CPU, so it is identical on every device and rank
        p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
