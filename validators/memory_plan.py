"""Per-rank GPU memory plan of one curriculum stage, as the bundled job lays the model out (pure Python).

``memory_plan(recipe, stage_index) -> MemoryPlan`` gives the bytes of every term on the pipeline rank that
needs the most, so a benchmark can set ``MemoryPlan.allocated_bytes`` beside
``torch.cuda.max_memory_allocated()`` term by term. docs/memory-plan.md explains each term; the rule
``V4-MEMORY`` (rules/memory.py) compares ``total_bytes`` with ``cluster.gpu_memory_gib``.

How the job holds the model (what the terms follow):

* storage: every parameter is fp32, bf16 only in compute (autocast; ``v4launch/training/step.py``), so
  parameters and gradients are 4 B per element; Muon keeps one fp32 momentum (4 B), AdamW two fp32
  moments (8 B) (``training/optim.py``, ``training/muon.py``); ``precision.params_dtype: bf16`` and the
  moment dtypes store less (``memory_storage.py``, which parameters: ``storage_policy.py``);
* pipeline: a rank holds the modules of its virtual stages of ``parallel.pp_layout``
  (``model/parallel/pipeline.py``: E = embedding, t = decoder layer, m = MTP layer, L = norm, head, hc_head);
* experts: each MoE layer keeps ``E / ep`` routed experts per rank (``model/parallel/expert.py``), never
  FSDP-sharded; with ``distributed_optimizer`` every other parameter, its gradient and optimizer state are
  sharded over the S = dp · cp ranks of the pipeline rank (FSDP2, ``model/parallel/fsdp.py``), and one
  decoder block at a time is gathered unsharded (two with prefetch, plus its unsharded gradient);
* bf16 weight copies: ``matmul.project`` / ``F.linear`` cast each weight to bf16 per forward and keep the
  copy for backward, and the grouped expert GEMM stacks bf16 copies of the local experts: 2 B per
  parameter of the stage, per micro-batch in flight;
* micro-batches in flight: 1 without a pipeline; ``min(pp - rank, accum)`` under 1F1B; the warm-up
  forwards of torch's interleaved 1F1B (``(vpp-1)·per_round + 2·(pp-1-rank)``, then one more) with vpp > 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from . import derived
from .memory_activations import (StageSetting, attention_workspace, backward_working_set, block_input_bytes_per_token,
                                 compressed_bytes, embed_bytes_per_token, head_bytes_per_token, layer_bytes_per_token,
                                 mtp_embeddings_bytes_per_token, mtp_extra_bytes_per_token, mtp_input_bytes_per_token,
                                 warmup_kl_gradient_bytes)
from .memory_storage import stored_low as _stored_low, training_state
from .param_count import ParamSpec, model_buffers, model_params
from .pipeline_schedule import PlanUnavailable, in_flight_ops, stage_layers, virtual_stages
from .recompute_policy import FULL_LAYER, RecomputeRefused, recompute_regions
from .schema.cluster import GPU_MEMORY_GIB
from .schema.recipe import Recipe

GIB = 1 << 30
LIBRARY_WORKSPACE_BYTES = 64 << 20
"""cuBLAS workspaces the caching allocator hands out on a GPU: 32 MiB for the forward's stream and 32 MiB for
autograd's backward thread (benchmarks/library_workspaces.py on an H200: 64.1 MiB); torch's
``max_memory_allocated`` sees them."""

HEADROOM_FIXED_BYTES = 2 * GIB
"""CUDA context, Triton and NCCL buffers: memory torch's allocator does not report."""
FRAGMENTATION = 0.05
"""Share of the allocated bytes the caching allocator loses to fragmentation (reserved minus allocated)."""
LOGIT_CHUNK_ELEMENTS = 1 << 28
"""Logits per chunk of the fused head + cross entropy (model/loss.py ``LOGIT_CHUNK_ELEMENTS``)."""


@dataclass(frozen=True)
class MemoryTerm:
    """One term of the plan: ``key`` (stable id), bytes on this rank, dtype and how it was counted."""

    key: str
    label: str
    bytes: int
    dtype: str
    detail: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """The memory of one pipeline rank in one curriculum stage.

    Attributes:
        stage_index, stage_name: the curriculum stage. pp_rank: the pipeline rank planned.
        rows: tokens per micro-batch on this rank (micro_batch_size · seq_len / cp).
        in_flight: micro-batch forwards held for backward (per virtual stage op under interleaving).
        terms: every term (bytes). budget_bytes: the GPU's memory (None for a CPU target without
            ``cluster.gpu_memory_gib``). ``headroom`` is the one term torch's allocator does not see.
        host_offload_bytes: pinned host memory this rank's offloaded layer inputs take at the peak (every
            micro-batch in flight; ``parallel.cpu_offloading``), 0 without offload.
    """

    stage_index: int
    stage_name: str
    pp_rank: int
    rows: int
    in_flight: int
    terms: tuple[MemoryTerm, ...]
    budget_bytes: int | None
    notes: tuple[str, ...] = field(default=())
    host_offload_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def allocated_bytes(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` should read: the total without the headroom term."""
        return sum(t.bytes for t in self.terms if t.key != "headroom")

    @property
    def fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        """JSON form (bytes): stage, rank, rows, in flight, every term, total, allocated, budget, fits."""
        return {"stage": self.stage_name, "pp_rank": self.pp_rank, "rows": self.rows, "in_flight": self.in_flight,
                "terms": [{"key": t.key, "label": t.label, "bytes": t.bytes, "dtype": t.dtype, "detail": t.detail}
                          for t in self.terms],
                "total_bytes": self.total_bytes, "allocated_bytes": self.allocated_bytes,
                "budget_bytes": self.budget_bytes, "fits": self.fits, "host_offload_bytes": self.host_offload_bytes}

    def term(self, key: str) -> MemoryTerm:
        return next(t for t in self.terms if t.key == key)

    def largest(self, n: int = 3, without: tuple[str, ...] = ()) -> list[MemoryTerm]:
        """The ``n`` largest terms (keys in ``without`` left out), largest first."""
        return sorted((t for t in self.terms if t.key not in without), key=lambda t: -t.bytes)[:n]


def budget_bytes(recipe: Recipe) -> int | None:
    """``cluster.gpu_memory_gib`` or the GPU model's catalogue value, in bytes; None for a CPU target
    without an explicit ``cluster.gpu_memory_gib``."""
    c = recipe.cluster
    gib = c.gpu_memory_gib if c.gpu_memory_gib is not None else GPU_MEMORY_GIB[c.gpu]
    return int(gib * GIB) if gib else None


@dataclass
class _StageCost:
    """Per-micro-batch bytes of one virtual stage on this rank."""

    activations: float = 0.0
    topk: float = 0.0
    cp: float = 0.0
    loss: float = 0.0
    weight_copies: float = 0.0
    backward_set: float = 0.0
    recompute_layer: float = 0.0
    attention_workspace: float = 0.0
    loss_transient: float = 0.0
    offloaded: float = 0.0
    offload_inputs: list = field(default_factory=list)  # bytes of each offloaded layer input (cpu_offloading)

    @property
    def offload_resident(self) -> float:
        """What the GPU holds of the offloaded inputs in backward: the layer re-run and the one prefetched after it,
        at most the two largest."""
        return sum(sorted(self.offload_inputs)[-2:])


_SPECS_CACHE: dict[tuple[int, str], tuple] = {}


def _specs_by_place(m, phase: str) -> tuple[dict, dict]:
    """Parameters and buffer bytes keyed by (holder, layer): ("E", None), ("L", None), ("t", id) (MTP
    layers included). Cached per model section object and phase (a validate run plans each stage and
    its proposed fixes with the same model)."""
    key = (id(m), phase)
    hit = _SPECS_CACHE.get(key)
    if hit is not None and hit[0] is m:
        return hit[1], hit[2]
    if len(_SPECS_CACHE) > 16:
        _SPECS_CACHE.clear()
    params: dict[tuple, list[ParamSpec]] = {}
    for s in model_params(m, phase):
        params.setdefault((s.holder if s.layer is None else "t", s.layer), []).append(s)
    buffers: dict[tuple, int] = {}
    for b in model_buffers(m):
        buffers[("t", b.layer)] = buffers.get(("t", b.layer), 0) + b.numel * b.itemsize
    _SPECS_CACHE[key] = (m, params, buffers)
    return params, buffers


@lru_cache(maxsize=1 << 15)
def _gemm_weight(name: str, optimizer: str) -> bool:
    """Cast to bf16 for a GEMM and kept for backward: every matrix (Muon's, the router gate, the head, mHC's
    ``hc_*_fn``), not the embedding, norms, biases, ape or sinks. Cached: a fix search asks ~300K times."""
    return optimizer == "muon" or name.endswith(("gate.weight", "head.weight")) or name.rsplit(".", 1)[-1].endswith("_fn")


def _setting(recipe: Recipe, index: int) -> StageSetting:
    st = recipe.curriculum.stages[index]
    p = recipe.parallel
    cp, dp = recipe.stage_cp(st), recipe.stage_dp(st)
    if dp is None:
        raise PlanUnavailable("the stage's dp is undefined (V4-WORLD-SIZE)")
    if st.seq_len % cp:
        raise PlanUnavailable(f"seq_len {st.seq_len} does not split into cp = {cp} slices (V4-CP-DIVISIBLE)")
    if (dp * cp) % p.ep or recipe.model.moe.n_routed_experts % p.ep:
        raise PlanUnavailable(f"parallel.ep={p.ep} does not fold over dp·cp = {dp * cp} or split the experts "
                              "evenly (V4-EP-FOLD, V4-EP-EXPERTS): the experts per GPU are undefined")
    backend = st.kernel_backend or recipe.attention.kernel_backend
    captured = recipe.compile.cuda_graph and derived.graph_free_reason(backend) is None
    return StageSetting(
        rows=p.micro_batch_size * st.seq_len // cp, seq_len=st.seq_len, cp=cp, shard=dp * cp,
        accum=max(1, recipe.stage_global_batch(st) // (p.micro_batch_size * dp)),
        act=2 if recipe.precision.dtype == "bf16" else 4, kernels=backend == "triton" and recipe.cluster.sm == 90,
        topk=min(recipe.model.indexer.topk, max(1, st.seq_len // derived.CSA_RATIO)), phase=st.phase,
        recompute=frozenset(_regions(recipe)),
        chunk=recipe.attention.kl_chunk_size, captured=captured,
        offload=recipe.parallel.cpu_offloading and FULL_LAYER in _regions(recipe))


def _regions(recipe: Recipe) -> list[str]:
    try:
        return recompute_regions(recipe.parallel.recompute_granularity, recipe.parallel.recompute_modules)
    except RecomputeRefused as refused:
        raise PlanUnavailable(f"V4-RECOMPUTE refuses {refused.field}={refused.value!r}") from None


def _stage_cost(m, symbols: tuple[str, ...], layers: list[int], carries_mtp_embeddings: bool,
                params: list[ParamSpec], ep: int, s: StageSetting, low: set[str]) -> _StageCost:
    """Per-micro-batch bytes of one virtual stage (activations by layer, compressed KV, top-k, loss).

    ``low``: names of the parameters stored in bf16 (``precision.params_dtype``): autocast uses them as they
    are, so they have no bf16 copy (the routed experts' grouped GEMM still stacks one)."""
    c = _StageCost()
    full = FULL_LAYER in s.recompute
    layer_copies = _layer_weight_copies(params, ep, low) if (full and s.act == 2) else {}
    for layer in layers:
        ratio = m.compress_ratios[layer] if layer < len(m.compress_ratios) else 0
        per = layer_bytes_per_token(m, ratio, s.phase, kernels=s.kernels, act=s.act, topk=s.topk,
                                    recompute=frozenset() if full else s.recompute)
        own = sum(v for k, v in per.items() if k != "top-k") * s.rows
        extra = mtp_extra_bytes_per_token(m, s.act) * s.rows if layer >= m.n_layers else 0.0
        if extra and s.offload:  # mtp_input's saved tensors go to host with the block's input
            c.offloaded += mtp_input_bytes_per_token(m, s.act) * s.rows
            extra -= mtp_input_bytes_per_token(m, s.act) * s.rows
        gathered = compressed_bytes(m, ratio, s, ratio == 4 and s.phase != "dense")
        c.activations += warmup_kl_gradient_bytes(m, ratio, s) * s.rows  # kept from forward to backward, both ways
        if full:  # the layer keeps its input streams; backward re-runs it whole, one layer at a time
            kept = block_input_bytes_per_token(m, s.act) * s.rows
            received = layer == layers[0] and "E" not in symbols  # the stage's input: the pipeline holds it
            if s.offload and not received:  # in host memory between the layer's forward and its backward
                c.offloaded += kept
                c.offload_inputs.append(kept)
                kept = 0.0
            c.activations += kept + extra
            c.recompute_layer = max(c.recompute_layer, own + per["top-k"] * s.rows + gathered
                                    + layer_copies.get(layer, 0.0))
        else:
            c.activations += own + extra
            c.topk += per["top-k"] * s.rows
            c.cp += gathered
        c.backward_set = max(c.backward_set, backward_working_set(m, s))
        c.attention_workspace = max(c.attention_workspace, attention_workspace(m, ratio, s))
    if "E" in symbols and s.offload and layers:  # the first layer's fp32 input streams go to host whole
        first = (embed_bytes_per_token(m, s.act) + block_input_bytes_per_token(m, s.act)) * s.rows
        c.offloaded += embed_bytes_per_token(m, s.act) * s.rows
        c.offload_inputs[0] = first  # the first layer's: its streams are fp32
    elif "E" in symbols:
        c.activations += embed_bytes_per_token(m, s.act) * s.rows
    if carries_mtp_embeddings:
        c.activations += mtp_embeddings_bytes_per_token(m) * s.rows
    if "L" in symbols or any(layer >= m.n_layers for layer in layers):  # a head runs here (main or MTP)
        c.loss += ("L" in symbols) * head_bytes_per_token(m, s.act) * s.rows
        chunk = min(s.rows, max(1, LOGIT_CHUNK_ELEMENTS // m.vocab_size))
        # a head's forward forms its gradients (model/loss.py): the chunk's fp32 logits, softmax and bf16
        # gradient (10 B per logit), an fp32 weight gradient [V, d] per head on this stage (each held until
        # that head's backward: the main head's while the MTP heads run), and the gradients of the rows
        # through the final norm and hc_head (fp32 streams)
        heads = ("L" in symbols) + sum(layer >= m.n_layers for layer in layers)
        c.loss_transient = (10.0 * chunk * m.vocab_size + 4.0 * heads * m.vocab_size * m.dim
                            + s.rows * (4 * m.mhc.hc_mult * m.dim + 12 * m.dim))
    if s.act == 2:
        c.weight_copies = 2.0 * sum(p.numel // (ep if p.routed else 1) for p in params
                                    if _copied(p, low) and not (full and _in_block(p)))
    return c


_BLOCK_PART = re.compile(r"\.(attn|ffn)\.|\.(attn_norm|ffn_norm|hc_attn_[a-z]+|hc_ffn_[a-z]+)(\.|$)")


def _in_block(p: ParamSpec) -> bool:
    """A parameter that ``Block.forward`` uses (attention, MoE, norms, mHC mixing); not an MTP layer's
    enorm / hnorm / e_proj / h_proj / head, which run outside it."""
    return p.layer is not None and _block_part(p.name)


@lru_cache(maxsize=1 << 15)
def _block_part(name: str) -> bool:
    """:func:`_in_block`'s name test (cached, as :func:`_gemm_weight`)."""
    return bool(_BLOCK_PART.search(name))


def _copied(p: ParamSpec, low: set[str]) -> bool:
    """A GEMM weight whose forward keeps a bf16 copy for backward: fp32-stored ones (autocast's cast), and the
    routed experts whatever their storage (the grouped GEMM stacks them, ``moe.run_local_experts``)."""
    return _gemm_weight(p.name, p.optimizer) and (p.routed or p.name not in low)


def _layer_weight_copies(params: list[ParamSpec], ep: int, low: set[str]) -> dict[int, float]:
    """bf16 GEMM weight copies of each layer's ``Block.forward`` (what a whole-layer recompute re-creates)."""
    out: dict[int, float] = {}
    for p in params:
        if _copied(p, low) and _in_block(p):
            out[p.layer] = out.get(p.layer, 0.0) + 2.0 * (p.numel // (ep if p.routed else 1))
    return out


def _rank_plan(recipe: Recipe, index: int, rank: int, stages: list[tuple[str, ...]], s: StageSetting) -> MemoryPlan:
    m, p = recipe.model, recipe.parallel
    by_place, buffers = _specs_by_place(m, s.phase)
    layer_ids = stage_layers(stages, m.n_layers)
    e_at = next(i for i, st in enumerate(stages) if "E" in st)
    m_at = next((i for i, ids in enumerate(layer_ids) if any(x >= m.n_layers for x in ids)), e_at)
    local = [i for i in range(len(stages)) if i % p.pp == rank]
    costs, rank_params, rank_buffers, blocks = {}, [], 0, [0]
    for i in local:
        params = [sp for key in ([("E", None)] if "E" in stages[i] else []) + [("L", None)] * ("L" in stages[i])
                  + [("t", x) for x in layer_ids[i]] for sp in by_place.get(key, [])]
        rank_params += params
        rank_buffers += sum(buffers.get(("t", x), 0) for x in layer_ids[i])
        blocks += [sum(sp.numel for sp in by_place.get(("t", x), []) if not sp.routed) for x in layer_ids[i]]
        low = {sp.name for sp in params if _stored_low(recipe, sp)}
        costs[i] = _stage_cost(m, stages[i], layer_ids[i], bool(m.mtp.depth) and e_at <= i <= m_at, params, p.ep, s,
                               low)
    ops = [local[j] for j in in_flight_ops(p.pp, p.vpp, rank, s.accum) if j < len(local)] or local[:1]
    shard = s.shard if p.distributed_optimizer else 1
    st = training_state(recipe, rank_params, shard)
    root = sum(sp.numel for sp in rank_params if not sp.routed and sp.layer is None)
    fsdp = 12 * max(max(blocks), root) if p.distributed_optimizer and shard > 1 else 0
    ws = max((costs[i].backward_set + costs[i].attention_workspace + costs[i].recompute_layer for i in local),
             default=0.0)
    ce = max((costs[i].loss_transient for i in local), default=0.0)
    sum_ops = lambda attr: int(sum(getattr(costs[i], attr) for i in ops))  # noqa: E731
    # under cpu_offloading the GPU holds the input of the layer backward re-runs and of the one prefetched after it
    resident = int(max((costs[i].offload_resident for i in local), default=0.0))
    saved = sum(sum_ops(k) for k in ("weight_copies", "activations", "cp", "topk", "loss")) + resident
    grads_at_peak, grads_note = st.grad_bytes, "as the parameters, kept across micro-batches"
    if s.captured:
        grads_note = ("compile.cuda_graph: the graph's gradient tensors stay allocated between replays"
                      + (" (each replay writes them)" if s.accum == 1 else " (zeroed in place)"))
    elif p.pp == 1 and s.accum == 1:  # zeroed (None) every step: allocated while backward frees activations
        grads_at_peak = max(0, grads_at_peak - saved)
        grads_note = "one micro-batch per step: allocated as backward frees activations (beyond them)"
    terms = [
        MemoryTerm("parameters", "parameters", st.param_bytes + rank_buffers, st.dtype, st.param_note),
        MemoryTerm("gradients", "gradients", grads_at_peak, st.dtype, grads_note),
        MemoryTerm("optimizer", "optimizer states", st.optimizer_bytes, st.optimizer_dtype, st.optimizer_note),
        MemoryTerm("weight_copies", "bf16 weight copies", sum_ops("weight_copies"), "bf16",
                   f"GEMM operands kept for backward, {len(ops)} in flight"),
        MemoryTerm("activations", "activations", sum_ops("activations") + resident, "bf16/fp32",
                   f"{s.rows} rows x {len(ops)} micro-batch forwards in flight"
                   + (", layer inputs in host memory but 2" if s.offload else "")),
        MemoryTerm("compressed_kv", "compressed KV + CP boundary", sum_ops("cp"), "bf16",
                   f"gathered over cp={s.cp}" if s.cp > 1 else "local entries (cp=1)"),
        MemoryTerm("topk", "top-k indices + KL", sum_ops("topk"), "int32/fp32",
                   f"k={s.topk}" if s.kernels and s.phase != "dense" else "inside recomputed chunks"),
        MemoryTerm("loss", "logits + loss buffers", sum_ops("loss"), "bf16/fp32",
                   f"head in chunks of {LOGIT_CHUNK_ELEMENTS // max(m.vocab_size, 1)} rows"),
        MemoryTerm("transients", "backward transients", int(max(ws, ce)), "bf16/fp32",
                   ("one layer re-run whole + its backward + attention workspace" if FULL_LAYER in s.recompute
                    else "one layer's backward + attention workspace") if ws >= ce else "head + loss chunk, weight grad"),
        MemoryTerm("fsdp", "FSDP unsharded block", fsdp, "fp32", "gathered params x2 + grads" if fsdp else "no FSDP"),
        MemoryTerm("workspaces", "library workspaces", LIBRARY_WORKSPACE_BYTES if recipe.cluster.sm else 0, "-",
                   "cuBLAS, forward stream and backward thread"),
    ]
    allocated = sum(t.bytes for t in terms)
    terms.append(MemoryTerm("headroom", "headroom", int(HEADROOM_FIXED_BYTES + FRAGMENTATION * allocated), "-",
                            f"context/NCCL {HEADROOM_FIXED_BYTES // GIB} GiB + {FRAGMENTATION:.0%} fragmentation"))
    return MemoryPlan(index, recipe.curriculum.stages[index].name, rank, s.rows, len(ops), tuple(terms),
                      budget_bytes(recipe), host_offload_bytes=sum_ops("offloaded"))


def rank_plans(recipe: Recipe, stage_index: int) -> list[MemoryPlan]:
    """The plan of every pipeline rank for curriculum stage ``stage_index``.

    Raises: PlanUnavailable when the layout or the stage's parallel sizes are invalid (other rules say why)."""
    s = _setting(recipe, stage_index)
    stages = virtual_stages(recipe)
    return [_rank_plan(recipe, stage_index, r, stages, s) for r in range(recipe.parallel.pp)]


_PLAN_CACHE: dict[tuple[int, int], tuple[Recipe, MemoryPlan]] = {}


def memory_plan(recipe: Recipe, stage_index: int) -> MemoryPlan:
    """The plan of the pipeline rank that needs the most memory in curriculum stage ``stage_index``.

    Args:
        recipe: a validated ``Recipe``. stage_index: index into ``curriculum.stages``.
    Returns: :class:`MemoryPlan` (bytes per term; ``allocated_bytes`` to compare with
        ``torch.cuda.max_memory_allocated``; ``total_bytes`` with the GPU's memory).
    Raises:
        PlanUnavailable: invalid layout or parallel sizes. IndexError: no such stage.
    """
    key = (id(recipe), stage_index)
    hit = _PLAN_CACHE.get(key)
    if hit is not None and hit[0] is recipe:  # the rule and the report's figures plan the same stage
        return hit[1]
    if len(_PLAN_CACHE) > 64:
        _PLAN_CACHE.clear()
    plan = max(rank_plans(recipe, stage_index), key=lambda p: p.total_bytes)
    _PLAN_CACHE[key] = (recipe, plan)
    return plan
