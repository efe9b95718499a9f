"""Every recipe field, and what makes it take effect: a reader in the job, or a rule that refuses it.

``COVERAGE`` maps each leaf field of the schema (``curriculum.stages.*.seq_len`` for list items) to one of:

* :class:`Honoured` — a named function (or table) of the job / launcher reads it (``module:qualname``);
  ``via`` names a schema helper that the reader calls and that reads the field
  (``Recipe.stage_cp`` for ``parallel.cp``);
* :class:`Refused` — the job does not implement a non-default value: rule ``rule`` fails a recipe that
  sets it (``example`` is such a setting, as a dotlist override);
* :class:`Checked` — the field is itself a limit the contract checks (its whole effect): rule ``rule`` fails
  when ``example`` crosses it;
* :class:`Inert` — the job's behaviour is the same for every value, with the reason.

``tests/validators/test_field_coverage.py`` checks that this table covers the schema exactly, that each
reader really reads the field (the attribute appears in its source, parsed, never imported), and that each
rule really fails ``example`` naming the field, the value and the fix. Pure data: never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Honoured:
    reader: str
    via: str | None = None


@dataclass(frozen=True)
class Refused:
    rule: str
    example: str


@dataclass(frozen=True)
class Checked:
    rule: str
    example: str


@dataclass(frozen=True)
class Inert:
    reason: str


Coverage = Union[Honoured, Refused, Checked, Inert]

ADAPTER = "v4launch.training.model_adapter:model_args_from_recipe"
PLAN = "v4launch.training.plan:plan_curriculum"
RUNNER_INIT = "v4launch.training.runner:Runner.__init__"
STEP_WEIGHTS = "v4launch.training.step:loss_weights"
OPTIM = "v4launch.training.optim:Optimizers.add_params"
LR = "v4launch.training.plan:LRSchedule.__init__"
SBATCH = "v4launch.slurm.params:RESOURCE_MAP"
EXECUTOR = "v4launch.slurm.params:executor_parameters"
DATA_KEY = "v4launch.data.prepare:cache_key"
STORAGE = "v4launch.training.master_weights:StorageOptions.from_precision"
STAGE_CP = "v4launch.validators.schema.recipe:Recipe.stage_cp"
STAGE_GBS = "v4launch.validators.schema.recipe:Recipe.stage_global_batch"

_MODEL_FIELDS = ("vocab_size", "dim", "n_layers", "compress_ratios", "n_heads", "head_dim", "rope_head_dim",
                 "q_lora_rank", "o_groups", "o_lora_rank", "window_size", "norm_eps", "init_std",
                 "rope.rope_theta", "rope.compress_rope_theta", "rope.yarn.factor", "rope.yarn.original_seq_len",
                 "rope.yarn.beta_fast", "rope.yarn.beta_slow", "rope.softmax_scale",
                 "indexer.n_heads", "indexer.head_dim", "indexer.topk", "indexer.hadamard",
                 "moe.n_routed_experts", "moe.n_activated_experts", "moe.n_shared_experts", "moe.moe_inter_dim",
                 "moe.route_scale", "moe.n_hash_layers", "moe.swiglu_limit",
                 "mhc.hc_mult", "mhc.sinkhorn_iters", "mhc.eps", "mtp.depth")

COVERAGE: dict[str, Coverage] = {
    "name": Honoured("v4launch.rundir:create_run_dir"),
    "description": Honoured("v4launch.cli.report_format:header"),
    **{f"model.{f}": Honoured(ADAPTER) for f in _MODEL_FIELDS},
    "model.max_position_embeddings": Checked("V4-SEQ-MAXPOS", "model.max_position_embeddings=2048"),
    "model.init_from_released": Honoured("v4launch.training.runner:Runner.__init__"),
    "model.moe.balance_loss_alpha": Honoured(STEP_WEIGHTS),
    "model.moe.bias_update_speed": Honoured("v4launch.training.runner:Runner._one_step"),
    "model.mtp.loss_weight": Honoured(STEP_WEIGHTS),
    "model.mtp.loss_weight_after_decay": Honoured(STEP_WEIGHTS),
    "attention.indexer_loss_coeff": Honoured(STEP_WEIGHTS),
    "attention.kernel_backend": Honoured(PLAN),
    "attention.kl_chunk_size": Honoured("v4launch.training.runner:Runner._build"),
    "attention.indexer_qat": Refused("V4-UNIMPL-INDEXER-QAT", "attention.indexer_qat=true"),
    "parallel.tp": Refused("V4-TP-ONE", "parallel.tp=2"),
    "parallel.pp": Honoured(RUNNER_INIT),
    "parallel.vpp": Honoured(RUNNER_INIT),
    "parallel.pp_layout": Honoured(RUNNER_INIT),
    "parallel.cp": Honoured(PLAN, via=STAGE_CP),
    "parallel.cp_partition": Refused("V4-CP-CONTIGUOUS", "parallel.cp_partition=zigzag"),
    "parallel.qkv_format": Refused("V4-UNIMPL-BSHD", "parallel.qkv_format=bshd"),
    "parallel.ep": Honoured(RUNNER_INIT),
    "parallel.micro_batch_size": Honoured(PLAN),
    "parallel.global_batch_size": Honoured(PLAN, via=STAGE_GBS),
    "parallel.distributed_optimizer": Honoured(RUNNER_INIT),
    "parallel.recompute_granularity": Honoured("v4launch.training.plan:recompute_names"),
    "parallel.recompute_modules": Honoured("v4launch.training.plan:recompute_names"),
    "parallel.cpu_offloading": Honoured(RUNNER_INIT),
    "parallel.offload_modules": Refused("V4-UNIMPL-OFFLOAD", "parallel.offload_modules=[core_attn]"),
    "precision.dtype": Honoured(RUNNER_INIT),
    "precision.fp8_recipe": Honoured("v4launch.model.parallel.precision:fp8_module_filter"),
    "precision.fp8_dispatch": Honoured("v4launch.model.parallel.precision:apply_fp8"),
    "precision.keep_fp32_params": Inert(
        "the pinned parameters (ape, attn_sink, hc_*, router bias) are FP32 under every precision.params_dtype "
        "(validators/storage_policy.py stores only GEMM matrices in bf16): true keeps them FP32, false lifts a "
        "pin that changes nothing; V4-PREC-FP32-DISTOPT-PP still reads it for runtimes that store BF16"),
    "precision.params_dtype": Honoured(RUNNER_INIT),
    "precision.store_param_remainders": Honoured(STORAGE),
    "precision.exp_avg_dtype": Honoured(STORAGE),
    "precision.exp_avg_sq_dtype": Honoured(STORAGE),
    "precision.policy.compressor_gemm": Refused("V4-PREC-BF16-PINS", "precision.policy.compressor_gemm=fp8"),
    "precision.policy.indexer_weights_proj": Refused("V4-PREC-BF16-PINS", "precision.policy.indexer_weights_proj=fp8"),
    "precision.policy.indexer_qk": Refused("V4-PREC-INDEXER-QK", "precision.policy.indexer_qk=fp8"),
    "precision.policy.ape": Refused("V4-PREC-FP32-PINS", "precision.policy.ape=bf16"),
    "precision.policy.attn_sink": Refused("V4-PREC-FP32-PINS", "precision.policy.attn_sink=bf16"),
    "compile.enable": Honoured(RUNNER_INIT),
    "compile.backend": Honoured(RUNNER_INIT),
    "compile.cuda_graph": Honoured("v4launch.training.graph_step:stage_graph_plan"),
    "cluster.gpu": Honoured(SBATCH),
    "cluster.nodes": Honoured(SBATCH),
    "cluster.gpus_per_node": Honoured(SBATCH),
    "cluster.gpu_memory_gib": Honoured("v4launch.validators.memory_plan:budget_bytes"),
    "cluster.host_memory_gib": Checked("V4-HOST-MEMORY", "cluster.host_memory_gib=100"),
    "cluster.intra_node_gb_per_s": Honoured("v4launch.validators.time_plan:link_gb_s"),
    "cluster.inter_node_gb_per_s": Honoured("v4launch.validators.time_plan:link_gb_s"),
    **{f"curriculum.stages.*.{f}": Honoured(PLAN)
       for f in ("name", "seq_len", "phase", "indexer_loss", "kernel_backend", "tokens", "steps", "lr")},
    "curriculum.stages.*.cp": Honoured(PLAN, via=STAGE_CP),
    "curriculum.stages.*.global_batch_size": Honoured(PLAN, via=STAGE_GBS),
    "optimizer.name": Honoured(OPTIM),
    "optimizer.lr": Honoured(OPTIM),
    "optimizer.muon_lr": Honoured(OPTIM),
    "optimizer.min_lr": Honoured("v4launch.training.plan:LRSchedule.lr"),
    "optimizer.weight_decay": Honoured(OPTIM),
    "optimizer.betas": Honoured(OPTIM),
    "optimizer.eps": Honoured(OPTIM),
    "optimizer.muon_momentum": Honoured(OPTIM),
    "optimizer.warmup_steps": Honoured(LR),
    "optimizer.schedule": Honoured(LR),
    "optimizer.decay_fraction": Honoured(LR),
    "optimizer.grad_clip": Honoured("v4launch.training.runner:Runner._one_step"),
    "data.source": Honoured(DATA_KEY),
    "data.paths": Honoured("v4launch.data.prepare:_write"),
    "data.jsonl_key": Honoured(DATA_KEY),
    "data.blend.*.weight": Honoured("v4launch.data.blend:prepare_blend"),
    "data.blend.*.prefix": Honoured("v4launch.data.blend:prepare_blend"),
    "data.tokenizer": Honoured("v4launch.training.data_io:prepare_for_run"),
    "data.prefix": Honoured("v4launch.data.prepare:prepare_dataset"),
    "data.max_documents": Honoured(DATA_KEY),
    "data.validation_fraction": Honoured(DATA_KEY),
    "data.seed": Honoured("v4launch.training.data_io:stage_loader"),
    "data.packing": Honoured("v4launch.training.data_io:stage_loader"),
    "checkpointing.interval_steps": Honoured("v4launch.training.runner:Runner.run_stage"),
    "checkpointing.keep_last": Honoured("v4launch.training.runner:Runner.save"),
    "logging.interval_steps": Honoured("v4launch.training.runner:Runner._one_step"),
    "logging.tensorboard": Honoured("v4launch.training.job:_train"),
    "logging.eval_interval_steps": Honoured("v4launch.training.runner:Runner.run_stage"),
    "logging.plot": Honoured("v4launch.training.runner:Runner.finish_stage"),
    "logging.wandb.project": Honoured("v4launch.training.trackers:WandbLogger.__init__"),
    "logging.wandb.name": Honoured("v4launch.training.trackers:WandbLogger.__init__"),
    "logging.wandb.mode": Honoured("v4launch.training.trackers:WandbLogger.__init__"),
    "run.output_root": Honoured("v4launch.rundir:create_run_dir"),
    "run.seed": Honoured(RUNNER_INIT),
    "run.deterministic": Honoured(RUNNER_INIT),
    "run.threads": Honoured(RUNNER_INIT),
    "run.gc_interval_steps": Honoured(RUNNER_INIT),
    **{f"slurm.{f}": Honoured(SBATCH)
       for f in ("partition", "account", "qos", "time_min", "cpus_per_task", "mem_gb", "signal_delay_s", "setup")},
    "slurm.container_image": Honoured(EXECUTOR),
    "slurm.container_mounts": Honoured(EXECUTOR),
    "slurm.additional_parameters": Honoured(EXECUTOR),
    "slurm.max_restarts": Honoured("v4launch.slurm.render:make_executor"),
    "slurm.max_segments": Honoured("v4launch.slurm.job:SlurmTrainJob._after_stop"),
    "slurm.master_port": Honoured("v4launch.slurm.job:SlurmTrainJob.__call__"),
}
"""Field path → how the job honours or refuses it (module docstring)."""
