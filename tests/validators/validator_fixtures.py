"""A small V4 recipe that exercises every rule (PP2, a CP2 stage, SM90 fused kernels) and validates clean.

Each rule test applies one mutation (a dotlist override) to this base and expects exactly
that rule to fail (or warn), and a passing twin where the rule applies and passes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

FIXTURE_DATA = Path(__file__).resolve().parent / "data"
"""A released-format directory (index only) and a dense-phase import record, for V4-RELEASED-INIT."""

BASE: dict[str, Any] = {
    "name": "fixture",
    "model": {
        "vocab_size": 512, "dim": 256, "n_layers": 8,
        "compress_ratios": [0, 4, 128, 4, 128, 4, 128, 4, 0],
        "n_heads": 4, "head_dim": 64, "rope_head_dim": 16, "q_lora_rank": 64,
        "o_groups": 2, "o_lora_rank": 64, "window_size": 64, "max_position_embeddings": 65536,
        "indexer": {"n_heads": 4, "head_dim": 32, "topk": 16},
        "moe": {"n_routed_experts": 8, "n_activated_experts": 2, "n_shared_experts": 1, "moe_inter_dim": 128, "n_hash_layers": 1},
        "mtp": {"depth": 1},
    },
    "attention": {"indexer_loss_coeff": 0.01, "kernel_backend": "triton"},
    "parallel": {"tp": 1, "pp": 2, "pp_layout": "Et*4|t*4mL", "cp": 1, "ep": 2, "micro_batch_size": 1,
                 "global_batch_size": 8, "distributed_optimizer": True},
    "precision": {"dtype": "bf16", "fp8_recipe": "none", "keep_fp32_params": False},
    "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 8},
    "curriculum": {"stages": [
        {"name": "dense_4k", "seq_len": 4096, "phase": "dense", "steps": 10},
        {"name": "warmup_4k", "seq_len": 4096, "phase": "warmup", "steps": 10},
        {"name": "sparse_4k", "seq_len": 4096, "phase": "sparse", "steps": 10},
        {"name": "sparse_8k", "seq_len": 8192, "phase": "sparse", "cp": 2, "kernel_backend": "reference", "steps": 10},
    ]},
}

ONE_GPU_GRAPH = ["compile.cuda_graph=true", "parallel.pp=1", "parallel.pp_layout=null", "parallel.ep=1",
                 "parallel.distributed_optimizer=false", "curriculum.stages.3.cp=1"]
"""The base with one GPU per model replica and its step captured (what V4-CUDA-GRAPH admits)."""

# rule id → (failing overrides, passing-twin overrides). The twin is a recipe where the rule
# applies (not n/a) and passes; [] means the base itself.
CASES: dict[str, tuple[list[str], list[str]]] = {
    "V4-WORLD-SIZE": (["cluster.gpus_per_node=7"], []),
    "V4-EP-EXPERTS": (["model.moe.n_routed_experts=7"], []),
    "V4-EP-FOLD": (["parallel.ep=8"], ["parallel.ep=4"]),
    "V4-BATCH": (["parallel.global_batch_size=6"], ["parallel.global_batch_size=12"]),
    "V4-TP-ONE": (["parallel.tp=2"], []),
    "V4-RATIOS-LENGTH": (["model.compress_ratios=[0,4,128,4,128,4,128,4]"], []),
    "V4-OGROUPS": (["model.o_groups=3"], ["model.o_groups=4"]),
    "V4-MODEL-BUILD": (["model.rope_head_dim=15"], ["model.rope_head_dim=32"]),
    "V4-RECOMPUTE": (["parallel.recompute_granularity=selective", "parallel.recompute_modules=[core_attn]"],
                     ["parallel.recompute_granularity=selective", "parallel.recompute_modules=[mla_up_proj]"]),
    "V4-RECOMPUTE-REPLAY": (["parallel.recompute_granularity=full"],
                            ["parallel.recompute_granularity=selective", "parallel.recompute_modules=[moe_act,layernorm]"]),
    "V4-OFFLOAD-QKV": (["parallel.offload_modules=[qkv_linear]"], ["parallel.offload_modules=[core_attn]"]),
    "V4-KERNEL-SM90": (["cluster.gpu=cpu"], []),
    "V4-SM90-DENSE-LOSS": (["curriculum.stages.1.kernel_backend=cudnn"], []),
    "V4-KERNEL-AVAILABLE": (["attention.kernel_backend=cudnn", "curriculum.stages.1.kernel_backend=triton"], []),
    "V4-KERNEL-TRITON-SM90": (["cluster.gpu=B200"], ["cluster.gpu=H200"]),
    "V4-CP-THD": (["parallel.qkv_format=bshd"], []),
    "V4-CP-CONTIGUOUS": (["parallel.cp_partition=zigzag"], []),
    "V4-CP-SM": (["cluster.gpu=RTX5090", "attention.kernel_backend=reference"],
                 ["cluster.gpu=B200", "attention.kernel_backend=reference"]),
    "V4-CP-BOUNDARY": (["curriculum.stages.3.seq_len=200"], ["curriculum.stages.3.seq_len=256"]),
    "V4-CP-DIVISIBLE": (["curriculum.stages.3.seq_len=8191"], []),
    "V4-CP-MICRO-BATCH": (["parallel.micro_batch_size=2", "parallel.global_batch_size=16"], []),
    "V4-PREC-BF16-PINS": (["precision.policy.compressor_gemm=fp8"], []),
    "V4-PREC-FP32-PINS": (["precision.policy.attn_sink=bf16"], []),
    "V4-PREC-INDEXER-QK": (["precision.policy.indexer_qk=fp8"], ["precision.policy.indexer_qk=fp8", "attention.indexer_qat=true"]),
    "V4-PREC-FP32-DISTOPT-PP": (["precision.keep_fp32_params=true"], ["precision.keep_fp32_params=true", "parallel.distributed_optimizer=false"]),
    "V4-FP8-SM": (["precision.fp8_recipe=mxfp8"], ["precision.fp8_recipe=blockwise"]),
    "V4-FP8-BUILD": (["precision.fp8_recipe=blockwise", "model.moe.moe_inter_dim=120"], ["precision.fp8_recipe=blockwise"]),
    "V4-PP-LAYOUT-SYNTAX": (["parallel.pp_layout=Et*4|t*4mX"], []),
    "V4-PP-LAYOUT": (["parallel.pp_layout=Et*3|t*4mL"], []),
    "V4-PP-HASH-FIRST": (["model.moe.n_hash_layers=5"], ["model.moe.n_hash_layers=4"]),
    "V4-PP-BALANCE": (["parallel.pp_layout=Et|t*7mL"], []),
    # a vocabulary that makes the lone L stage as costly as a decoder stage, so only this rule trips
    "V4-PP-MTP-WITH-LOSS": (["parallel.pp=4", "parallel.pp_layout=Et*4|t*4|m|L", "model.vocab_size=9216"], []),
    "V4-PHASE-INDEXER-LOSS": (["attention.indexer_loss_coeff=0"], []),
    "V4-PHASE-DENSE-NO-INDEXER": (["curriculum.stages.0.indexer_loss=dense"], []),
    "V4-PHASE-INDEXER-TARGET": (["curriculum.stages.1.indexer_loss=sparse"], ["curriculum.stages.1.indexer_loss=dense"]),
    "V4-PP-VPP": (["parallel.pp=1", "parallel.vpp=2"], ["parallel.vpp=2", "parallel.pp_layout=Et*3|t*2|t*2|tmL"]),
    "V4-PP-MICROBATCHES": (["parallel.global_batch_size=4"], []),
    "V4-PHASE-ORDER": (["curriculum.stages.3.phase=dense"], []),
    "V4-PHASE-SKIP-WARMUP": (["curriculum.stages.1.phase=sparse"], []),
    "V4-SOFTMAX-SCALE": (["model.rope.softmax_scale=0.1596"], ["model.rope.softmax_scale=0.125"]),
    "V4-COMPRESS-ROPE-THETA": (["model.init_from_released=imported/flash", "model.rope.compress_rope_theta=40000"],
                               ["model.init_from_released=imported/flash"]),
    "V4-SEQ-MAXPOS": (["model.max_position_embeddings=4096"], []),
    "V4-TOPK-VISIBLE": (["model.indexer.topk=2048"], ["model.indexer.topk=1024"]),
    "V4-VOCAB": (["model.vocab_size=256"], ["model.vocab_size=257"]),
    "V4-RELEASED-INIT": ([f"model.init_from_released={FIXTURE_DATA / 'released_dir'}"],
                         [f"model.init_from_released={FIXTURE_DATA / 'dense_import'}"]),
    # refusals of what the job does not implement (rules/unimplemented.py); the twin is the base (default value)
    "V4-UNIMPL-OFFLOAD": (["parallel.offload_modules=[core_attn]"], []),
    "V4-UNIMPL-INDEXER-QAT": (["attention.indexer_qat=true"], []),
    "V4-UNIMPL-BSHD": (["parallel.qkv_format=bshd", "curriculum.stages.3.cp=1"], []),
    # fails where wandb is not installed (the test extra leaves it out); the twin logs nothing
    "V4-WANDB-INSTALLED": (["logging.wandb.project=fixture"], ["logging.wandb.project=fixture",
                                                                "logging.wandb.mode=disabled"]),
    # the base spreads a replica over pp 2, ep 2 and the distributed optimizer; the twin is one GPU per replica
    "V4-CUDA-GRAPH": (["compile.cuda_graph=true"], ONE_GPU_GRAPH),
    "V4-CUDA-GRAPH-UNUSED": ([*ONE_GPU_GRAPH, "attention.kernel_backend=reference"], ONE_GPU_GRAPH),
    # a 64K stage at cp 2 on a 6 GiB budget: the plan's fix (cp 4) fits
    "V4-MEMORY": (["cluster.gpu_memory_gib=6", "curriculum.stages.3.seq_len=65536"], []),
    # the twin recomputes whole layers at ep 1 and cp 1, where the recompute replays no collective
    # (V4-RECOMPUTE-REPLAY would warn at the base's ep 2 and its cp 2 stage)
    "V4-OFFLOAD-RECOMPUTE": (["parallel.cpu_offloading=true"],
                             ["parallel.cpu_offloading=true", "parallel.recompute_granularity=full",
                              "parallel.ep=1", "curriculum.stages.3.cp=1"]),
    # 8 ranks x (offloaded inputs + 16 GiB per process) > 100 GiB; 1 TiB holds them
    "V4-HOST-MEMORY": (["cluster.host_memory_gib=100"], ["cluster.host_memory_gib=1024"]),
    "V4-SLURM-SIGNAL": (["slurm.signal_delay_s=14400"], ["slurm.signal_delay_s=14000"]),  # time_min 240 min
    # 4e7 steps of ~1.3 ms on 8 H100s: ~14.4 h, 4 jobs of 238 min of training
    "V4-SLURM-SEGMENTS": (["curriculum.stages.0.steps=40000000", "slurm.max_segments=3"],
                          ["curriculum.stages.0.steps=40000000", "slurm.max_segments=4"]),
}

UNIMPLEMENTED_PREFIX = "V4-UNIMPL-"
"""Rules that refuse a setting the job does not implement. A contract rule's fixture may need such a
setting (FP8 on SM90, recompute module names, indexer QAT): that refusal fires beside it and is
left out when the contract rule's own outcome is checked."""


ALSO_FAILS: dict[str, set[str]] = {"V4-SM90-DENSE-LOSS": {"V4-KERNEL-AVAILABLE"}}
"""Rules a failing fixture trips beside its own where no recipe can trip the one alone: V4-SM90-DENSE-LOSS
refuses only the cudnn backend, which V4-KERNEL-AVAILABLE refuses as not shipped."""


def unimplemented_refusals(rule_ids: set[str], own: str) -> set[str]:
    """``rule_ids`` without the V4-UNIMPL-* refusals other than ``own``."""
    return {r for r in rule_ids if not r.startswith(UNIMPLEMENTED_PREFIX) or r == own}


def base() -> dict[str, Any]:
    """A fresh deep copy of the base recipe dict."""
    return copy.deepcopy(BASE)
