"""The seam: apply a parallel layout to the single-device V4 model (docs/parallelism.md "The seam").

``parallelize(model, dims, groups, device) -> ParallelModel`` takes the ``V4Model`` every rank
built identically (same seed) and returns what this rank runs. Order, fixed (torchtitan's
``parallelize_deepseekv3``): expert parallel → pipeline split → FP8 GEMMs, recompute, host offload and
``torch.compile`` per part → parameter storage → FSDP → CP hooks. The model
files stay single-device; every step here changes module structure or installs hooks from
outside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..model import V4Model
from .base import SINGLE_DEVICE, ContextParallel
from .expert import apply_expert_parallel
from ..compile import compile_blocks
from .fsdp import apply_fsdp, decoder_blocks, routed_expert_params, set_divide_factor, shard_mesh
from .precision import apply_fp8
from .offload import apply_activation_offload
from .recompute import apply_recompute
from .storage import apply_param_storage
from .pipeline import PipelineParallel, StageSpec, cut_stage, local_specs, stage_specs


@dataclass(frozen=True)
class ParallelDims:
    """The run's fixed parallel sizes (``parallel.*`` of the recipe; dp and cp vary per curriculum stage).

    Attributes:
        pp, vpp, pp_layout: pipeline ranks, virtual stages per rank and the layout string
            (required when pp · vpp > 1).
        ep: expert-parallel size (folds over the S ranks of a pipeline rank).
        distributed_optimizer: shard parameters, gradients and optimizer state with FSDP2.
        recompute: the region names to recompute (``recompute.modules_from_recipe``: selective names, or
            ``["full"]`` for whole layers).
        compile_backend: ``torch.compile`` each block with this backend (``compile.backend`` of the recipe
            when ``compile.enable``); None: run eagerly.
        params_dtype: storage of the GEMM weights FSDP does not shard (``precision.params_dtype``;
            ``storage.apply_param_storage``).
        cpu_offloading: the layer inputs whole-layer recompute keeps go to pinned host memory
            (``parallel.cpu_offloading``; ``offload.apply_activation_offload``).
    """

    pp: int = 1
    vpp: int = 1
    pp_layout: Optional[str] = None
    ep: int = 1
    distributed_optimizer: bool = False
    recompute: tuple[str, ...] = ()
    compile_backend: Optional[str] = None
    params_dtype: str = "fp32"
    cpu_offloading: bool = False

    @property
    def pipelined(self) -> bool:
        return self.pp * self.vpp > 1


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups (None where the size is 1).

    Attributes:
        pp_rank: this rank's pipeline rank.
        pipeline: the pipeline group (one rank per pipeline rank, pipeline-rank order).
        shard: the S group (the dp · cp ranks of this pipeline rank; None = the world when pp = 1), for FSDP.
        ep_rank, ep: this rank's index in its EP group (contiguous ``ep`` ranks inside S) and that group.
        dp: data-parallel replicas of the first curriculum stage (``S / cp``): FSDP's gradient divide factor.
    """

    pp_rank: int = 0
    pipeline: Any = None
    shard: Any = None
    ep_rank: int = 0
    ep: Any = None
    dp: int = 1


@dataclass
class ParallelModel:
    """What one rank runs.

    Attributes:
        model: a ``V4Model`` holding exactly this rank's modules under their single-device FQNs
            (the input model itself when pp = 1): give it to the optimizer and the checkpoint.
        parts: the modules the forward runs, one per local pipeline stage (``[model]`` when pp = 1).
        pipeline: the stages and schedules (None when pp = 1).
        specs: the local stages' :class:`StageSpec` s (empty when pp = 1).
        experts: the routed-expert parameters when ep > 1 (held by this EP rank only, not FSDP-sharded:
            their gradients are reduced over the edp group); empty when ep = 1.
        sharded: FSDP2 shards the other parameters over the S group (``distributed_optimizer``).
        fp8_modules, recomputed: FQNs of the modules converted to FP8 / the recomputed regions.
        low_precision: FQNs of the parameters stored in bf16; offloaded: FQNs of the layers whose inputs go to host.
        params_dtype: the storage applied (``ParallelDims.params_dtype``): a phase change stores the indexers it
            builds the same way, as a model built in that phase would.
        compiled: the number of blocks compiled (``model/compile.py``).
    """

    model: V4Model
    parts: list[V4Model]
    pipeline: Optional[PipelineParallel] = None
    specs: list[StageSpec] = field(default_factory=list)
    experts: frozenset = frozenset()
    sharded: bool = False
    fp8_modules: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    compiled: int = 0
    low_precision: list[str] = field(default_factory=list)
    offloaded: list[str] = field(default_factory=list)
    params_dtype: str = "fp32"

    def _all(self) -> list[V4Model]:
        return [self.model] + [p for p in self.parts if p is not self.model]

    def set_cp(self, hooks: ContextParallel, dp: Optional[int] = None) -> None:
        """Install the curriculum stage's CP hooks on every part (the last step of the seam); when sharded,
        FSDP's gradient divide factor becomes the stage's ``dp`` (S is fixed, dp = S / cp changes)."""
        for m in self._all():
            m.cp = hooks
        if self.sharded and dp is not None:
            set_divide_factor(self.parts, dp)

    def reshard(self) -> None:
        """Free the gathered parameters of every FSDP part after a forward-only pass (evaluation).

        FSDP keeps the root's parameters (``embed``, ``norm``, ``head``, ``hc_head_*``) gathered after its
        forward for the backward; without a backward they stay gathered, and the optimizer and the
        checkpoint (which hold the sharded DTensors) would meet plain tensors. No-op when not sharded."""
        if self.sharded:
            for part in self.parts:
                part.reshard()

    def set_phase(self, phase: str) -> None:
        """``V4Model.set_phase`` once on :attr:`model` (the parts share its blocks), then the parts follow.

        Raises:
            RuntimeError: a sharded model leaving "dense" (FSDP's parameter groups are fixed when
                ``fully_shard`` runs: the indexers would stay unsharded and unreduced). Fix: rebuild
                with ``parallelize(..., phase=phase)`` and move the state over by FQN, as the job does.
        """
        if self.sharded and self.model.phase == "dense" and phase != "dense":
            raise RuntimeError(f"phase dense -> {phase} on an FSDP-sharded model: the indexers must exist before "
                               "fully_shard. Fix: rebuild the model with parallelize(..., phase=...) and load the "
                               "state by FQN.")
        self.model.set_phase(phase)
        for p in self.parts:
            p.phase = phase
        if self.params_dtype != "fp32":  # the indexers just built, stored as a model built in this phase stores them
            self.low_precision = apply_param_storage(self.model, self.params_dtype, fsdp=self.sharded,
                                                     unsharded=self.experts)

    def set_kernel_backend(self, name: str) -> None:
        """``V4Model.set_kernel_backend`` on the model and every part."""
        for m in self._all():
            m.set_kernel_backend(name)



def parallelize(model: V4Model, dims: ParallelDims, groups: ParallelGroups, device: torch.device,
                cp: ContextParallel = SINGLE_DEVICE, phase: Optional[str] = None,
                precision: Any = None) -> ParallelModel:
    """Apply ``dims`` to ``model`` for this rank (see the module docstring for the order).

    Args:
        model: the single-device model, on ``device``, built identically on every rank.
        dims, groups: sizes and this rank's groups (:class:`ParallelDims`, :class:`ParallelGroups`).
        cp: the first curriculum stage's CP hooks (:meth:`ParallelModel.set_cp` changes them later).
        phase: move the rank's model to this phase after the pipeline split and before FSDP (the
            indexers are then built, with the RNG draws of an unsharded ``set_phase`` on the same rank,
            and sharded with their blocks); None keeps ``model``'s phase.
        precision: the recipe's ``precision`` section: its policy is checked and, with an fp8_recipe,
            the GEMMs the V4 policy allows become torchao FP8 (``precision.apply_fp8``); None skips both.
    Returns: :class:`ParallelModel`. With pp = 1 its ``model`` is ``model`` itself.
    Raises:
        ValueError: a pp_layout the pipeline cannot run (:func:`pipeline.stage_specs`); E % ep != 0 or an
            EP group that does not match ``dims.ep`` (:func:`expert.apply_expert_parallel`); FSDP's dp not
            dividing S or parameters of several dtypes (:func:`fsdp.apply_fsdp`); a recompute or
            precision setting the model cannot honour (:func:`recompute.apply_recompute`,
            :func:`precision.apply_fp8`).
    """
    # 1. Expert parallel: prune experts to this EP rank's, install the all-to-all dispatcher.
    if dims.ep > 1:
        apply_expert_parallel(model, groups.ep, dims.ep, groups.ep_rank)
    # 2. Pipeline split: keep only this rank's stages.
    if dims.pipelined:
        pm = _split(model, dims, groups, device)
    else:
        pm = ParallelModel(model=model, parts=[model])
    if dims.ep > 1:
        pm.experts = frozenset(routed_expert_params(pm.parts))
    if phase is not None and phase != pm.model.phase:
        pm.set_phase(phase)
    # 2b. Per-module transforms of each part (they share blocks with pm.model): FP8 GEMMs, recompute, compile.
    if dims.compile_backend is not None:
        # A fresh compiler state, as in a new process: graphs and module bookkeeping left by an earlier model in
        # this process (a rebuild at a phase change, a second in-process run) made dynamo's tracer fail on the CPU
        # ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer").
        torch._dynamo.reset()
    for part in pm.parts:
        if precision is not None:
            pm.fp8_modules += apply_fp8(part, precision)
        pm.recomputed += apply_recompute(part, list(dims.recompute))
        if dims.cpu_offloading:
            pm.offloaded += apply_activation_offload(part)
        if dims.compile_backend is not None and decoder_blocks(part):
            pm.compiled += compile_blocks(part, backend=dims.compile_backend)
    # 2c. Storage: bf16 GEMM weights outside FSDP (in place: pm.experts and the parts keep the same Parameters).
    pm.low_precision = apply_param_storage(pm.model, dims.params_dtype, fsdp=dims.distributed_optimizer,
                                           unsharded=pm.experts)
    pm.params_dtype = dims.params_dtype
    # 3. FSDP: fully_shard per block, per MTP layer, then per part, over the S group (experts left to EP).
    if dims.distributed_optimizer:
        apply_fsdp(pm.parts, shard_mesh(groups.shard, device.type), dp=groups.dp, ignored_params=pm.experts)
        pm.sharded = True
        if pm.model is not pm.parts[0]:
            _adopt_direct_params(pm.model, pm.parts)
    # 4. CP hooks.
    pm.set_cp(cp)
    return pm


def _adopt_direct_params(view: V4Model, parts: list[V4Model]) -> None:
    """Point the rank view's own parameters (``hc_head_*``) at the parts' sharded ones.

    ``fully_shard(part)`` replaces the parameters registered directly on the part by DTensors; the
    view registers the same names itself (submodules are shared, so their parameters follow), so
    without this the optimizer and the checkpoint would see the old, unsharded tensors.
    """
    for part in parts:
        for name, param in part.named_parameters(recurse=False):
            if getattr(view, name, None) is not None:
                setattr(view, name, param)


def _split(model: V4Model, dims: ParallelDims, groups: ParallelGroups, device: torch.device) -> ParallelModel:
    """Cut this rank's stages out of ``model`` and a rank view over all of them."""
    a = model.args
    if dims.pp_layout is None:
        raise ValueError(f"parallel.pp={dims.pp}, parallel.vpp={dims.vpp}: a pipeline needs parallel.pp_layout. "
                         "Fix: set parallel.pp_layout (`v4launch validate` proposes one).")
    specs = local_specs(stage_specs(dims.pp_layout, dims.pp, dims.vpp, a.n_layers, a.n_mtp_layers), groups.pp_rank)
    parts = [cut_stage(model, s) for s in specs]
    union = StageSpec(index=specs[0].index, n_stages=specs[0].n_stages, pp_rank=groups.pp_rank,
                      layer_ids=tuple(i for s in specs for i in s.layer_ids),
                      has_embed=any(s.has_embed for s in specs), has_mtp=any(s.has_mtp for s in specs),
                      has_loss=any(s.has_loss for s in specs))
    view = cut_stage(model, union, cls=V4Model)
    act_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    pipeline = PipelineParallel(parts, specs, groups.pipeline, device, act_dtype)
    return ParallelModel(model=view, parts=parts, pipeline=pipeline, specs=specs)

