"""Parameter storage (``precision.params_dtype``) applied to a built model from outside: bf16 GEMM weights.

Spec: validators/storage_policy.py (which parameters, and why FSDP-sharded and FP32-pinned ones stay fp32);
design.md "Plans are promises" (storage precision is a recipe choice). The optimizer keeps each bf16
weight's exact fp32 master and computes the update in fp32 (``v4launch/training/master_weights.py``); the
model sees bf16 weights, which autocast uses as they are (no per-forward bf16 copy) and which
``matmul.project`` upcasts under fp32 compute.

An fp32 weight keeps its exact value as the optimizer's first master (``master_weights.store_in_bf16``: the
bf16 value is its rounding, the remainder waits on the parameter), so storage changes no weight the optimizer
steps. The conversion is in place (``param.data``): the ``nn.Parameter`` objects stay the same, so a pipeline
rank's view, the routed-expert set of expert parallelism and FQNs are unchanged. Call it before FSDP and
before building the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...validators.storage_policy import stores_low_precision
from ...training.master_weights import store_in_bf16

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``precision.params_dtype`` -> torch dtype."""


def apply_param_storage(model: nn.Module, params_dtype: str, *, fsdp: bool,
                        unsharded: Iterable[nn.Parameter] = ()) -> list[str]:
    """Store the GEMM weight matrices of ``model`` in ``params_dtype`` (in place); returns their FQNs.

    Args:
        model: the rank's model (a ``V4Model`` or a pipeline rank's view: the parts share its modules).
        params_dtype: "fp32" (nothing changes) or "bf16".
        fsdp: FSDP2 will shard the parameters (``parallel.distributed_optimizer``); those stay fp32 shards,
            except ``unsharded`` (the routed experts FSDP ignores under expert parallelism).
    Returns: FQNs converted, in ``named_parameters`` order ([] for fp32).
    Raises:
        ValueError: a ``params_dtype`` other than fp32 / bf16, with the field and the fix.
    """
    if params_dtype not in STORAGE_DTYPES:
        raise ValueError(f"precision.params_dtype={params_dtype!r}: must be one of {sorted(STORAGE_DTYPES)}. "
                         "Fix: set precision.params_dtype=bf16 or fp32.")
    dtype = STORAGE_DTYPES[params_dtype]
    if dtype == torch.float32:
        return []
    keep = set(unsharded)
    done = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and stores_low_precision(name, p.ndim, fsdp_sharded=fsdp and p not in keep):
            if p.dtype == torch.float32:
                store_in_bf16(p)
            elif p.dtype != dtype:
                p.data = p.data.to(dtype)
            done.append(name)
    return done
