"""Process-group set-up, the rank grid of each stage and the few collectives the job needs.

The rendezvous comes from the environment (torchrun, the local launcher or Slurm via
v4launch.slurm): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Backend: nccl
when CUDA is available, else gloo.

Rank grid (docs/parallelism.md "Rank grid"): the world size ``W`` and the pipeline size ``pp``
are fixed for the run; ``S = W / pp`` ranks ("data × context") sit on each pipeline rank, and
a stage with context-parallel size ``cp`` lays them out as ``[dp][cp]``, ``dp = S / cp``::

    rank = pp_rank * S + dp_rank * cp + cp_rank      CP innermost and contiguous, PP outermost
    CP group (p, d): ranks p*S + d*cp .. p*S + d*cp + cp - 1
    S group p:       ranks p*S .. p*S + S - 1        (the ranks that hold the same stages)
    pipeline group j: ranks j, S + j, 2*S + j, ...   (the same data, one rank per pipeline rank)

so with one node per CP group the boundary exchange and the all-gather stay on the node.
All groups of every CP size the curriculum uses are created once at start-up
(:class:`Groups`; ``new_group`` is collective over the whole world, so every rank creates
every group in the same order). With pp = 1 the S group is the world.

Gradients: every parameter has a gradient tensor on every rank (zeros where unused) and one
flat all-reduce SUM over the S group, divided by ``dp``, replaces "SUM over CP, then mean over
DP" (:func:`average_grads`). Proof: with ``g[d][c]`` the gradient of DP replica ``d``, CP rank
``c``, the CP sum gives ``G[d] = Σ_c g[d][c]`` on every rank of CP group ``d``; the DP mean
gives ``(1/dp) Σ_d G[d] = (1/dp) Σ_d Σ_c g[d][c] = (1/dp) Σ_S g``, the same on every rank of
the S group. (DP groups are therefore never built.) Scalars the model returns replicated on
every CP rank (all losses) average to their DP mean over the S group: ``Σ_S x / S = Σ_d
cp·x[d] / (dp·cp)``. Each pipeline rank holds other parameters, so its S group reduces only
them; the gradient norm sums the squared norms of the pipeline ranks (``data_parallel.clip_grad_norm``).
Instead of DDP (whose buckets would have to be rebuilt when a phase change adds the indexer
parameters) this is one flat all-reduce per step with a fixed order.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """This rank's place in the world. ``owns_group``: this job created the process group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_distributed() -> DistInfo:
    """Join the process group described by the environment (no-op when WORLD_SIZE <= 1).

    An already initialised group (e.g. a test harness) is reused and left alone at teardown.
    On CUDA the group has two backends, ``cpu:gloo,cuda:nccl``: device tensors (gradients,
    activations) go over NCCL, while the host-side counts and objects that checkpointing and
    the CP loss normalisation exchange go over gloo instead of failing on an NCCL-only group.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world <= 1 and not dist.is_initialized():
        return DistInfo(rank=0, world=1, local_rank=0, device=device, owns_group=False)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo", init_method="env://")
        owns = True
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device,
                    owns_group=owns)


def teardown(info: DistInfo) -> None:
    """Destroy the process group if this job created it.

    The closing barrier is skipped while an exception propagates (called from a ``finally``): the
    other ranks may be waiting in a collective or a pipeline receive that this rank will never
    join, and the barrier would hang this rank instead of letting it report its error.
    """
    if info.owns_group and dist.is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


def _shard_size(world: int, pp: int) -> int:
    """S = world / pp, the ranks of one pipeline rank. Raises ValueError when pp does not divide world."""
    if pp < 1 or world % pp:
        raise ValueError(f"pp={pp} does not divide the world size {world}")
    return world // pp


def cp_group_ranks(world: int, cp: int, pp: int = 1) -> list[list[int]]:
    """The CP groups of a stage: ``[[p*S + d*cp + c for c in range(cp)] for p, d]`` with ``S = world / pp``.

    Raises:
        ValueError: ``pp`` does not divide ``world`` or ``cp`` does not divide ``S``.
    """
    S = _shard_size(world, pp)
    if cp < 1 or S % cp:
        raise ValueError(f"cp={cp} does not divide the world size {world}" if pp == 1 else
                         f"cp={cp} does not divide the {S} ranks of a pipeline rank (world {world} / pp {pp})")
    return [[p * S + d * cp + c for c in range(cp)] for p in range(pp) for d in range(S // cp)]


def pipeline_group_ranks(world: int, pp: int) -> list[list[int]]:
    """The pipeline groups: ``[[p*S + j for p in range(pp)] for j in range(S)]`` with ``S = world / pp``."""
    S = _shard_size(world, pp)
    return [[p * S + j for p in range(pp)] for j in range(S)]


def ep_group_ranks(world: int, ep: int, pp: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """The EP groups and the expert-data-parallel (edp) groups, both folded over the S ranks of each pipeline rank.

    EP group ``(p, j)``: ranks ``p*S + j*ep .. p*S + j*ep + ep - 1`` (contiguous, as CP: on one node when
    ep <= GPUs per node); edp group ``(p, i)``: ranks ``p*S + i + j*ep`` for ``j < S/ep``, the ranks that
    hold the same experts (EP rank ``i``). ``S = world / pp`` is the same in every curriculum stage, so
    the groups never change when a stage changes cp (validator rule V4-EP-FOLD: ``ep | dp·cp``).

    Returns: ``(ep_groups, edp_groups)``.
    Raises:
        ValueError: ``pp`` does not divide ``world`` or ``ep`` does not divide ``S``.
    """
    S = _shard_size(world, pp)
    if ep < 1 or S % ep:
        raise ValueError(f"ep={ep} does not divide the {S} ranks of a pipeline rank (world {world} / pp {pp})")
    ep_groups = [[p * S + j * ep + i for i in range(ep)] for p in range(pp) for j in range(S // ep)]
    edp_groups = [[p * S + j * ep + i for j in range(S // ep)] for p in range(pp) for i in range(ep)]
    return ep_groups, edp_groups


def dp_group_ranks(world: int, cp: int) -> list[list[int]]:
    """The DP groups of a stage (ranks with the same CP rank): ``[[d*cp + c for d in range(dp)] for c]``."""
    if cp < 1 or world % cp:
        raise ValueError(f"cp={cp} does not divide the world size {world}")
    return [[d * cp + c for d in range(world // cp)] for c in range(cp)]


@dataclass(frozen=True)
class Layout:
    """This rank's place in one stage's ``[pp][dp][cp]`` grid (see the module docstring).

    Attributes:
        world, dp, cp, pp: sizes (``world = pp · dp · cp``; tp = 1).
        dp_rank, cp_rank: ``divmod(rank % S, cp)``; the data loader is sharded by ``dp_rank / dp``
            (the ranks of a pipeline group read the same micro-batches).
        hooks: what the model gets as ``cp=``: a ``ContextParallelGroup`` over this rank's CP
            group when ``cp > 1``, else the single-device default.
        pp_rank: this rank's pipeline rank (``rank // S``).
        shard_group: the S group (ranks of this pipeline rank), None = the world (pp = 1).
        pipe_group: the pipeline group (one rank per pipeline rank), None when pp = 1.
        ep, ep_rank: expert-parallel size and this rank's index in its EP group (``(rank % S) % ep``).
        ep_group, edp_group: this rank's EP group and the group of ranks holding the same experts
            (None when ep = 1).
    """

    world: int
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    hooks: Any
    pp: int = 1
    pp_rank: int = 0
    shard_group: Any = None
    pipe_group: Any = None
    ep: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    edp_group: Any = None

    @property
    def shard_size(self) -> int:
        """S = dp · cp, the ranks of one pipeline rank."""
        return self.dp * self.cp

    def describe(self) -> str:
        """``dp 2 x cp 1`` (``pp 2 x dp 1 x cp 1`` under PP; for log lines)."""
        return describe_layout(self.dp, self.cp, self.pp, self.ep)


def describe_layout(dp: int, cp: int, pp: int = 1, ep: int = 1) -> str:
    """``dp 2 x cp 1``: a rank layout in log lines (a live ``Layout`` or one read from a manifest);
    ``pp 2 x dp 2 x cp 1`` under PP, `` x ep 2`` appended under EP."""
    text = f"dp {dp} x cp {cp}" if pp == 1 else f"pp {pp} x dp {dp} x cp {cp}"
    return text + (f" x ep {ep}" if ep > 1 else "")


class Groups:
    """The process groups of the rank grid, created once on every rank: pipeline and S groups
    (pp > 1), EP and edp groups (ep > 1) and the CP groups of every CP size in ``cp_sizes``.

    ``layout(cp)`` returns this rank's :class:`Layout` for a stage with that CP size.
    """

    def __init__(self, info: DistInfo, cp_sizes: list[int] | set[int], pp: int = 1, ep: int = 1) -> None:
        from ..model.parallel import SINGLE_DEVICE, ContextParallelGroup

        self.info, self.pp, self.ep = info, pp, ep
        self.shard_size = info.world // pp
        self.pp_rank = info.rank // self.shard_size
        self.pipe_group = self.shard_group = None
        if pp > 1:  # collective: same groups, same order on every rank
            S = self.shard_size
            self.pipe_group = _create_groups(pipeline_group_ranks(info.world, pp), info.rank)
            self.shard_group = _create_groups([list(range(p * S, (p + 1) * S)) for p in range(pp)], info.rank)
        self.ep_rank = (info.rank % self.shard_size) % ep
        self.ep_group = self.edp_group = None
        if ep > 1:
            ep_groups, edp_groups = ep_group_ranks(info.world, ep, pp)
            self.ep_group = _create_groups(ep_groups, info.rank)
            self.edp_group = _create_groups(edp_groups, info.rank)
        self._hooks: dict[int, Any] = {1: SINGLE_DEVICE}
        for cp in sorted(set(cp_sizes) - {1}):
            self._hooks[cp] = ContextParallelGroup(_create_groups(cp_group_ranks(info.world, cp, pp), info.rank))

    def layout(self, cp: int) -> Layout:
        """This rank's layout for a stage of CP size ``cp`` (one of ``cp_sizes``)."""
        if cp not in self._hooks:
            raise ValueError(f"no CP groups of size {cp} were built (sizes: {sorted(self._hooks)})")
        dp_rank, cp_rank = divmod(self.info.rank % self.shard_size, cp)
        return Layout(world=self.info.world, dp=self.shard_size // cp, cp=cp, dp_rank=dp_rank, cp_rank=cp_rank,
                      hooks=self._hooks[cp], pp=self.pp, pp_rank=self.pp_rank, shard_group=self.shard_group,
                      pipe_group=self.pipe_group, ep=self.ep, ep_rank=self.ep_rank, ep_group=self.ep_group,
                      edp_group=self.edp_group)


def _create_groups(rank_lists: list[list[int]], rank: int) -> Any:
    """``dist.new_group`` for every list (collective: every rank of the world calls it with the same lists,
    in the same order); returns the group holding ``rank`` (None if none does)."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def fill_missing_grads(params: list[torch.Tensor]) -> None:
    """Give every parameter a gradient tensor (zeros where the step did not reach it)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def average_grads(params: list[torch.Tensor], info: DistInfo, dp: int | None = None, group: Any = None) -> None:
    """SUM gradients over each CP group and average them over the ``dp`` data-parallel replicas.

    One flat all-reduce SUM over ``group`` (the S group; None = the world) in a fixed order,
    divided by ``dp`` (default: the world, i.e. cp = 1); equal to CP-sum + DP-mean (module
    docstring). The reduction itself is ``model.parallel.data_parallel.reduce_gradients``
    (float32 buffer, float64 when a gradient is float64); a single process does nothing.
    """
    if not info.active:
        return
    from ..model.parallel.data_parallel import reduce_gradients

    reduce_gradients(params, group, info.world if dp is None else dp)


def sum_tensors(tensors: list[torch.Tensor], info: DistInfo, group: Any = None) -> None:
    """All-reduce (sum) ``tensors`` in place over ``group`` (the S group; None = the world), e.g. the
    experts' token counts before the bias update (each rank counts only its own rows, so the S-group
    sum is the global load under CP and DP)."""
    if info.active:
        for t in tensors:
            dist.all_reduce(t, group=group)


def mean_scalars(values: dict[str, float], info: DistInfo, group: Any = None) -> dict[str, float]:
    """Average a dict of floats over the ranks of ``group`` (None = the world; same keys on every
    rank of the group, sorted order)."""
    if not info.active or not values:
        return values
    keys = sorted(values)
    size = dist.get_world_size(group) if group is not None else info.world
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, group=group)
    return {k: float(v) / size for k, v in zip(keys, t.tolist())}


def gather_objects(obj: Any, group: Any) -> list[Any]:
    """Every rank's picklable ``obj`` over ``group``, in group-rank order (collective)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def merge_over(values: dict[str, float], group: Any) -> dict[str, float]:
    """The union of every rank's ``values`` over ``group`` (e.g. each pipeline rank's losses of its
    own layers); a key present on several ranks keeps the value of the lowest rank."""
    out: dict[str, float] = {}
    for part in reversed(gather_objects(values, group)):
        out.update(part)
    return dict(sorted(out.items()))


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True if ``flag`` is true on any rank (all ranks agree, e.g. to stop at the same step)."""
    if not info.active:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
