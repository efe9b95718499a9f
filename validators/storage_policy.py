"""Which parameters ``precision.params_dtype: bf16`` stores in bf16 (pure Python: the plan and the job share it).

Spec: design.md "Plans are promises" (storage precision is a recipe choice); seed 000 §9 and seed 004
item 9 (the FP32-pinned components); Megatron-LM's precision-aware optimizer (``params_dtype``,
``store_param_remainders``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``).

A parameter is stored in bf16 when all of these hold:

* it is a GEMM weight matrix (2-D): attention projections, compressor and indexer matrices, shared and
  routed experts, the router gate, the head — not the embedding table (a lookup whose rows enter the
  residual streams in fp32), RMSNorm gains, the mHC parameters (``hc_*``), ``ape`` or ``attn_sink``
  (FP32-pinned by the V4 precision policy);
* FSDP does not shard it: with ``parallel.distributed_optimizer`` every parameter but the routed experts
  under ``ep > 1`` is an fp32 DTensor shard (FSDP2 reduces a group in one dtype, and the FP32-pinned
  parameters share their block's group); those are ``1/S`` of the dense weights, while the routed experts
  they leave out are ~97% of V4-Flash's parameters.

Bytes per stored parameter (memory plan, ``validators/memory_plan.py``)::

    params_dtype  store_param_remainders   weight + master      gradient
    fp32          -                        4                    4
    bf16          true                     2 + 2 (int16 bits)   2
    bf16          false                    2 + 4 (fp32 copy)    2

The optimizer keeps the exact fp32 master and computes every update in fp32
(``v4launch/training/master_weights.py``); gradients of a bf16 weight are bf16 (torch keeps ``.grad`` in
the parameter's dtype: accumulated in bf16 over the step's micro-batches) and are reduced over ranks in a
float32 buffer, rounded once (``model/parallel/data_parallel.reduce_gradients``).
"""

from __future__ import annotations

FP32_PINNED_LEAVES = ("ape", "attn_sink")
"""Parameter leaf names the V4 precision policy keeps in fp32 (``precision.policy.ape`` / ``attn_sink``)."""


def stores_low_precision(name: str, ndim: int, *, fsdp_sharded: bool) -> bool:
    """True when ``params_dtype: bf16`` stores parameter ``name`` (the model's FQN) in bf16.

    Args:
        name: FQN as ``V4Model.named_parameters`` gives it (``layers.3.ffn.experts.7.w1.weight``).
        ndim: the parameter's number of dimensions (only matrices, ``ndim == 2``, qualify).
        fsdp_sharded: FSDP2 shards it (then it stays an fp32 shard).
    Returns: whether it is a bf16-stored GEMM weight (see the module docstring for the list).
    """
    if fsdp_sharded or ndim != 2 or name == "embed.weight":
        return False
    parts = name.split(".")
    leaf = parts[-1]
    if leaf in FP32_PINNED_LEAVES or leaf.startswith("hc_"):
        return False
    return not (leaf == "weight" and len(parts) >= 2 and "norm" in parts[-2])
