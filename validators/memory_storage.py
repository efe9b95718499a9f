"""Bytes of a rank's training state: parameters, gradients and optimizer state under the recipe's storage options.

The memory plan's first three terms (``memory_plan.py``). Which parameters ``precision.params_dtype: bf16`` stores
in bf16 is ``storage_policy.py``'s decision, shared with the job; here each stored element is counted: fp32
weights and gradients 4 B, bf16 ones 2 B, their fp32 master 2 B as remainders (``precision.store_param_remainders``)
or 4 B as a copy, and the optimizer's moments at ``precision.exp_avg_dtype`` / ``exp_avg_sq_dtype`` (Muon keeps
one, AdamW two). Dense parameters are sharded over the FSDP ranks, the routed experts over ``parallel.ep``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from math import ceil

from .param_count import ParamSpec
from .schema.recipe import Recipe
from .storage_policy import stores_low_precision


@dataclass(frozen=True)
class TrainingState:
    """Bytes of this rank's parameters, gradients and optimizer state under the recipe's storage options."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    dtype: str
    optimizer_dtype: str
    param_note: str
    optimizer_note: str


def _matrix(name: str, optimizer: str) -> bool:
    """A 2-D GEMM weight (the spec lists no shapes: Muon's matrices, the router gate and the heads)."""
    return optimizer == "muon" or name.endswith(("ffn.gate.weight", "head.weight"))


def stored_low(recipe: Recipe, sp: ParamSpec) -> bool:
    """``precision.params_dtype: bf16`` stores ``sp`` in bf16 (FSDP shards all but the routed experts under EP)."""
    if recipe.precision.params_dtype != "bf16":
        return False
    p = recipe.parallel
    return _low(sp.name, sp.optimizer, p.distributed_optimizer and not (sp.routed and p.ep > 1))


@lru_cache(maxsize=1 << 14)
def _low(name: str, optimizer: str, sharded: bool) -> bool:
    """:func:`stores_low_precision` of one parameter (cached by its name, whose hash the string keeps: a validate
    run plans the same parameters hundreds of thousands of times while it searches fixes)."""
    return stores_low_precision(name, 2 if _matrix(name, optimizer) else 1, fsdp_sharded=sharded)


def training_state(recipe: Recipe, rank_params: list[ParamSpec], shard: int) -> TrainingState:
    """Parameter, gradient and optimizer bytes on this rank (validators/storage_policy.py for which
    parameters ``precision.params_dtype: bf16`` stores in bf16; dense parameters sharded over ``shard``,
    routed experts over ``parallel.ep``)."""
    pr, p = recipe.precision, recipe.parallel
    muon_name = recipe.optimizer.name == "muon_adamw"
    n = {"low": 0.0, "fp32": 0.0, "muon": 0.0, "adamw": 0.0, "dense": 0.0, "routed": 0.0}
    for sp in rank_params:
        div = p.ep if sp.routed else shard
        low = stored_low(recipe, sp)
        elements = sp.numel / div
        n["low" if low else "fp32"] += elements
        n["muon" if sp.optimizer == "muon" and muon_name else "adamw"] += elements
        n["routed" if sp.routed else "dense"] += sp.numel
    avg, avg_sq = (2 if pr.exp_avg_dtype == "bf16" else 4), (2 if pr.exp_avg_sq_dtype == "bf16" else 4)
    master = (2 if pr.store_param_remainders else 4) * n["low"]
    weights = 4 * n["fp32"] + 2 * n["low"]
    gib = lambda x: f"{x / 1e9:.2f}B"  # noqa: E731
    sharded_note = f" / {shard} (FSDP)" if shard > 1 else ""
    master_note = (f", fp32 master {'as 16-bit remainders' if pr.store_param_remainders else 'copy'} "
                   f"{gib(n['low'])}" if n["low"] else "")
    return TrainingState(
        param_bytes=ceil(weights), grad_bytes=ceil(weights), optimizer_bytes=ceil(master + avg * (n["muon"] + n["adamw"])
                                                                                  + avg_sq * n["adamw"]),
        dtype="bf16/fp32" if n["low"] else "fp32",
        optimizer_dtype="fp32" if avg == avg_sq == 4 and not n["low"] else "bf16/fp32",
        param_note=f"{gib(n['dense'])} dense{sharded_note} + {gib(n['routed'] / p.ep)} experts (E/ep)"
                   + (f"; {gib(n['low'])} in bf16" if n["low"] else ""),
        optimizer_note=f"Muon momentum {gib(n['muon'])}, AdamW moments {gib(n['adamw'])}{master_note}")


HOST_BYTES_PER_RANK = 16 << 30
"""Host memory one training process holds besides offloaded activations: the CUDA context's host side, torch and
Triton, NCCL's host buffers, the data loader and its token windows. A stated allowance, not a measurement of
Flash-width runs (docs/memory-plan.md, the "host: offloaded inputs" term)."""


def host_bytes_per_node(recipe: Recipe, plan: Any) -> int:
    """Host memory a node's ranks need in ``plan``'s stage: ``gpus_per_node × (offloaded inputs + the per-process
    allowance)`` (bytes; what V4-HOST-MEMORY checks against ``cluster.host_memory_gib``)."""
    return recipe.cluster.gpus_per_node * (plan.host_offload_bytes + HOST_BYTES_PER_RANK)
