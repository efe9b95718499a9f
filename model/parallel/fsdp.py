"""Sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) over the S ranks of one pipeline rank.

Spec: docs/parallelism.md "Rank grid" and "Sharded data parallel" (recipe field
``parallel.distributed_optimizer: true``). Upstream: torchtitan ``apply_fsdp`` (per-block
``fully_shard`` then the root; the flattened ``dp_shard_cp`` mesh) — reimplemented here.

Layout: ``S = dp · cp`` ranks of one pipeline rank form a 1-D mesh; every parameter that is
not ignored becomes a ``DTensor`` with placement ``Shard(0)`` over it (row chunks as
``torch.chunk``; a rank may hold an empty chunk). One FSDP group per decoder block
(``layers[...]``), per MTP layer (``mtp[...]``) and one per part (its remaining parameters:
``embed``, ``norm``, ``head``, ``hc_head_*``).

Gradients: the reduce-scatter over the S ranks yields ``(1/dp) · Σ_S g`` (the divide factor is
``dp``, not FSDP's default S): CP ranks hold partial gradients of one replica's batch, which
must be summed, while the dp replicas are averaged (docs/parallelism.md, "Rank grid").

Precision: no ``MixedPrecisionPolicy``: parameters stay in the dtype they were built in (float32
in training; bf16 compute comes from autocast, as on one device), so the FP32-pinned ones
(``ape``, ``attn_sink``, ``hc_*``; the router ``gate.bias`` is a buffer and is not sharded) are
float32 like every other parameter, and gradients are reduced in float32. Every sharded
parameter of a part must therefore have one dtype (FSDP reduces a group in one dtype).

Routed experts are passed as ``ignored_params``: they stay plain tensors (expert parallel), FSDP
neither shards nor reduces them; reduce their gradients with
``data_parallel.reduce_gradients(expert_params, edp_group, dp)``.

Job-facing calls::

    mesh = shard_mesh(s_group, device_type)       # s_group: dist.new_group(the S ranks), built on every rank
    apply_fsdp(parts, mesh, dp=dp, ignored_params=routed_expert_params(parts))
    ...                                           # curriculum stage with another cp (S unchanged):
    set_divide_factor(parts, dp_new)
    # gradient accumulation: part.set_requires_gradient_sync(i == accum - 1) before each backward
    # gradient norm / clipping: data_parallel.clip_grad_norm (torch's refuses DTensor + plain gradients)

Pipeline stages: FSDP gathers a module's parameters around its ``forward`` only. A stage that calls
a part's other methods (``embed_streams``, ``run_layers``, ``head_losses``) directly must call them
from one module ``forward`` (e.g. a stage wrapper that is the part passed here); registering them
with ``register_fsdp_forward_method`` instead adds one post-backward per call (see MTP below).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

MTP_FORWARD_METHODS = ("mtp_input", "mtp_hidden")
"""Methods of an MTP layer that ``V4Model`` calls outside the layer's ``forward``: FSDP must gather
the layer's parameters around them too (``register_fsdp_forward_method``)."""


def shard_mesh(mesh_or_group: DeviceMesh | dist.ProcessGroup | None, device_type: str) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over the S ranks of this pipeline rank.

    Args:
        mesh_or_group: a 1-D ``DeviceMesh`` (returned as is), or the ``ProcessGroup`` of the S
            ranks (``dist.new_group(ranks)``, created on every rank of the world in the same
            order); None means the default (world) group.
        device_type: "cuda" or "cpu" (the device the parameters live on).
    Returns: the mesh (``DeviceMesh.from_group``: no new process group is created).
    Raises:
        ValueError: a mesh with more than one dimension.
    """
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"sharded data parallel needs a 1-D mesh over the S = dp*cp ranks of one pipeline rank, "
                             f"got a {mesh_or_group.ndim}-D mesh {tuple(mesh_or_group.shape)}. Fix: pass the "
                             "process group of those ranks or a 1-D mesh built from it.")
        return mesh_or_group
    group = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, device_type)


def decoder_blocks(part: nn.Module) -> list[nn.Module]:
    """The decoder blocks a part holds: ``layers`` then ``mtp`` (``ModuleList`` or ``ModuleDict``; None skipped)."""
    blocks: list[nn.Module] = []
    for attr in ("layers", "mtp"):
        container = getattr(part, attr, None)
        if container is None:
            continue
        blocks.extend(container.values() if isinstance(container, nn.ModuleDict) else container)
    return blocks


def routed_expert_params(parts: Iterable[nn.Module]) -> set[nn.Parameter]:
    """Parameters of the routed experts (FQNs containing ``.ffn.experts.``) of every part."""
    return {p for part in parts for name, p in part.named_parameters() if ".ffn.experts." in name}


def _check_one_dtype(part: nn.Module, ignored: set[nn.Parameter]) -> None:
    dtypes: dict[torch.dtype, str] = {}
    for name, p in part.named_parameters():
        if p not in ignored:
            dtypes.setdefault(p.dtype, name)
    if len(dtypes) > 1:
        seen = ", ".join(f"{str(d).removeprefix('torch.')} (e.g. {n})" for d, n in dtypes.items())
        raise ValueError(f"sharded data parallel: the parameters of a part have several dtypes: {seen}. FSDP "
                         "reduces each group's gradients in one dtype. Fix: keep the model's parameters in float32 "
                         "(precision.dtype bf16 runs under autocast) instead of casting the model to bfloat16.")


def apply_fsdp(parts: list[nn.Module], mesh_or_group: DeviceMesh | dist.ProcessGroup | None, *, dp: int,
               ignored_params: Iterable[nn.Parameter] = (), reshard_after_forward: bool = True) -> None:
    """Shard every part in place: ``fully_shard`` on each decoder block and MTP layer, then on the part.

    Args:
        parts: the modules this rank holds (one per local pipeline stage); each becomes an FSDP root.
        mesh_or_group: the S = dp·cp ranks of this pipeline rank (see :func:`shard_mesh`).
        dp: data-parallel replicas among the S ranks; the reduce-scatter divides the summed
            gradient by ``dp`` (CP partial gradients are summed).
        ignored_params: parameters FSDP leaves alone (routed experts: :func:`routed_expert_params`).
        reshard_after_forward: free each block's gathered parameters after its forward (gathered
            again in backward); False keeps them (more memory, one all-gather fewer per block).
    Effects: parameters become ``DTensor`` (``Shard(0)``) in their original dtype; FQNs are
        unchanged. Gradients of parameters a rank did not use are reduced as zeros, so ranks whose
        batches reach different parameters (an HCA compressor on short segments) stay in step.
        On a CPU mesh (gloo) the reductions use SUM and a separate division (gloo has no AVG /
        PREMUL_SUM).
    Raises:
        ValueError: ``dp`` < 1 or not a divisor of the mesh size; a mesh that is not 1-D; parameters
            of several dtypes in one part.
    Source: torch 2.13 ``fully_shard``, ``FSDPModule.set_gradient_divide_factor``,
        ``set_reduce_scatter_unused_params``, ``set_force_sum_reduction_for_comms``,
        ``register_fsdp_forward_method``; torchtitan ``apply_fsdp``.
    """
    device_type = next((p.device.type for part in parts for p in part.parameters()), "cpu")
    mesh = shard_mesh(mesh_or_group, device_type)
    _check_dp(mesh.size(), dp)
    ignored = set(ignored_params)
    for part in parts:
        _check_one_dtype(part, ignored)
        mine = {p for p in part.parameters() if p in ignored}
        for block in decoder_blocks(part):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=mine)
            for method in MTP_FORWARD_METHODS:
                if hasattr(block, method):
                    register_fsdp_forward_method(block, method)
        fully_shard(part, mesh=mesh, ignored_params=mine)
        part.set_reduce_scatter_unused_params(True)
        for module in _fsdp_modules([part]):
            module.set_force_sum_reduction_for_comms(device_type == "cpu")
    set_divide_factor(parts, dp)


def set_divide_factor(parts: list[nn.Module], dp: int) -> None:
    """Make every FSDP group of ``parts`` divide its reduced gradients by ``dp`` (a stage changed cp; S is fixed).

    Raises:
        ValueError: ``dp`` < 1 or not a divisor of the shard mesh size; a part not sharded by :func:`apply_fsdp`.
    """
    if any(not isinstance(part, FSDPModule) for part in parts):
        raise ValueError("set_divide_factor: a part is not sharded. Fix: call apply_fsdp(parts, ...) first.")
    for part in parts:
        _check_dp(_shard_size(part), dp)
    for module in _fsdp_modules(parts):
        module.set_gradient_divide_factor(float(dp))


def _fsdp_modules(parts: Iterable[nn.Module]) -> list[FSDPModule]:
    return [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]


def _shard_size(part: nn.Module) -> int:
    """Size of the mesh the part's parameters are sharded over (1 if it holds no sharded parameter)."""
    return next((p.device_mesh.size() for p in part.parameters() if isinstance(p, DTensor)), 1)


def _check_dp(shard_size: int, dp: int) -> None:
    if dp < 1 or shard_size % dp:
        raise ValueError(f"sharded data parallel: dp={dp} must divide the shard group size S = dp*cp = {shard_size} "
                         "(the ranks of one pipeline rank). Fix: pass dp = S / cp of the current curriculum stage.")
