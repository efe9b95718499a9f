"""Other launchers' spellings of recipe fields, mapped to ours, for the unknown-key message.

A key written the way Megatron-LM (and Megatron-Bridge and Primus, which take Megatron's
argument names), a Hugging Face ``config.json`` or torchtitan spell it is answered with
"X is Megatron's name; here it is Y" instead of a guess by spelling. Matching ignores case and
reads ``-`` as ``_`` (``--moe-aux-loss-coeff`` works). ``N`` in a path stands for the stage index.
A peer setting with no field here (``moe_router_force_load_balancing``) is named as such, with why.
"""

from __future__ import annotations

MEGATRON = "Megatron's"
"""Megatron-LM argument / TransformerConfig names; Megatron-Bridge and Primus use them too."""
HF = "the Hugging Face config's"
TORCHTITAN = "torchtitan's"

PEER_NAMES: dict[str, tuple[str, str]] = {
    # Megatron-LM (and Megatron-Bridge / Primus)
    "num_layers": (MEGATRON, "model.n_layers"),
    # granularity full recomputes every layer (Megatron's uniform method with one layer per chunk)
    "recompute_method": (MEGATRON, "parallel.recompute_granularity"),
    "recompute_num_layers": (MEGATRON, "parallel.recompute_granularity"),
    "hidden_size": (HF + " and " + MEGATRON, "model.dim"),
    "num_attention_heads": (HF + " and " + MEGATRON, "model.n_heads"),
    "num_moe_experts": (MEGATRON, "model.moe.n_routed_experts"),
    "moe_router_topk": (MEGATRON, "model.moe.n_activated_experts"),
    "moe_ffn_hidden_size": (MEGATRON, "model.moe.moe_inter_dim"),
    "moe_aux_loss_coeff": (MEGATRON, "model.moe.balance_loss_alpha"),
    "moe_router_bias_update_rate": (MEGATRON, "model.moe.bias_update_speed"),
    "moe_router_topk_scaling_factor": (MEGATRON, "model.moe.route_scale"),
    "mtp_num_layers": (MEGATRON, "model.mtp.depth"),
    "mtp_loss_scaling_factor": (MEGATRON, "model.mtp.loss_weight"),
    "qk_pos_emb_head_dim": (MEGATRON, "model.rope_head_dim"),
    "rotary_base": (MEGATRON, "model.rope.rope_theta"),
    "norm_epsilon": (MEGATRON, "model.norm_eps"),
    "layernorm_epsilon": (MEGATRON, "model.norm_eps"),
    "init_method_std": (MEGATRON, "model.init_std"),
    "seq_length": (MEGATRON, "curriculum.stages.N.seq_len"),
    "padded_vocab_size": (MEGATRON, "model.vocab_size"),
    "csa_compress_ratios": (MEGATRON, "model.compress_ratios"),
    "dsa_indexer_topk": (MEGATRON, "model.indexer.topk"),
    "dsa_indexer_n_heads": (MEGATRON, "model.indexer.n_heads"),
    "dsa_indexer_head_dim": (MEGATRON, "model.indexer.head_dim"),
    "dsa_indexer_loss_coeff": (MEGATRON, "attention.indexer_loss_coeff"),
    "dsa_kernel_backend": (MEGATRON, "attention.kernel_backend"),
    "num_residual_streams": (MEGATRON, "model.mhc.hc_mult"),
    "mhc_sinkhorn_iterations": (MEGATRON, "model.mhc.sinkhorn_iters"),
    "tensor_model_parallel_size": (MEGATRON, "parallel.tp"),
    "pipeline_model_parallel_size": (MEGATRON, "parallel.pp"),
    "virtual_pipeline_model_parallel_size": (MEGATRON, "parallel.vpp"),
    "context_parallel_size": (MEGATRON, "parallel.cp"),
    "expert_model_parallel_size": (MEGATRON, "parallel.ep"),
    "pipeline_model_parallel_layout": (MEGATRON, "parallel.pp_layout"),
    "cp_partition_mode": (MEGATRON, "parallel.cp_partition"),
    "use_distributed_optimizer": (MEGATRON, "parallel.distributed_optimizer"),
    "adam_beta1": (MEGATRON, "optimizer.betas (a pair: [beta1, beta2])"),
    "adam_beta2": (MEGATRON, "optimizer.betas (a pair: [beta1, beta2])"),
    "adam_eps": (MEGATRON, "optimizer.eps"),
    "clip_grad": (MEGATRON, "optimizer.grad_clip"),
    "lr_warmup_iters": (MEGATRON, "optimizer.warmup_steps"),
    "lr_decay_style": (MEGATRON, "optimizer.schedule"),
    "train_iters": (MEGATRON, "curriculum.stages.N.steps"),
    "save_interval": (MEGATRON, "checkpointing.interval_steps"),
    "log_interval": (MEGATRON, "logging.interval_steps"),
    "eval_interval": (MEGATRON, "logging.eval_interval_steps"),
    "wandb_project": (MEGATRON, "logging.wandb.project"),
    "wandb_exp_name": (MEGATRON, "logging.wandb.name"),
    # precision-aware optimizer and offload (Megatron's DistributedOptimizer / TransformerConfig names)
    "use_precision_aware_optimizer": (MEGATRON, "precision.params_dtype, precision.exp_avg_dtype and "
                                                "precision.exp_avg_sq_dtype (each bf16)"),
    "main_grads_dtype": (MEGATRON, "precision.params_dtype (gradients follow the weights' storage: bf16 for bf16 "
                                   "weights, reduced in fp32)"),
    "main_params_dtype": (MEGATRON, "precision.store_param_remainders (the master is always exact fp32: 16-bit "
                                    "remainders or a copy)"),
    "cpu_offloading_num_layers": (MEGATRON, "parallel.cpu_offloading (every recomputed layer of a stage)"),
    "cpu_offloading_activations": (MEGATRON, "parallel.cpu_offloading"),
    # pipeline split: one layout string holds what Megatron spreads over several arguments
    "decoder_first_pipeline_num_layers": (MEGATRON, "parallel.pp_layout (the first stage's 't' count, e.g. "
                                                    "Et*10|t*12|t*12|t*9mL)"),
    "decoder_last_pipeline_num_layers": (MEGATRON, "parallel.pp_layout (the last stage's 't' count, before m and L)"),
    "num_layers_per_virtual_pipeline_stage": (MEGATRON, "parallel.vpp (virtual stages per rank) with a "
                                                        "parallel.pp_layout of pp·vpp stages"),
    "num_virtual_stages_per_pipeline_rank": (MEGATRON, "parallel.vpp"),
    "account_for_embedding_in_pipeline_split": (MEGATRON, "parallel.pp_layout (E in the first stage)"),
    "account_for_loss_in_pipeline_split": (MEGATRON, "parallel.pp_layout (L in the last stage)"),
    "micro_batch_size": (MEGATRON, "parallel.micro_batch_size"),
    "global_batch_size": (MEGATRON, "parallel.global_batch_size"),
    "recompute_granularity": (MEGATRON, "parallel.recompute_granularity"),
    "recompute_modules": (MEGATRON, "parallel.recompute_modules"),
    "moe_shared_expert_intermediate_size": (MEGATRON, "model.moe.moe_inter_dim (shared experts have the routed "
                                                      "width; their count is model.moe.n_shared_experts)"),
    "moe_router_enable_expert_bias": (MEGATRON, "model.moe.bias_update_speed (0 turns the bias update off)"),
    "moe_router_num_hash_layers": (MEGATRON, "model.moe.n_hash_layers"),
    "lr": (MEGATRON, "optimizer.lr"),
    "min_lr": (MEGATRON, "optimizer.min_lr"),
    "weight_decay": (MEGATRON, "optimizer.weight_decay"),
    "optimizer": (MEGATRON, "optimizer.name"),
    "fp8": (MEGATRON, "precision.fp8_recipe"),
    "fp8_recipe": (MEGATRON, "precision.fp8_recipe"),
    "bf16": (MEGATRON, "precision.dtype"),
    "tokenizer_model": (MEGATRON, "data.tokenizer"),
    "data_path": (MEGATRON, "data.paths"),
    "seed": (MEGATRON, "run.seed"),
    # Hugging Face config.json (DeepSeek-V3 / V4 releases)
    "num_hidden_layers": (HF, "model.n_layers"),
    "num_experts_per_tok": (HF, "model.moe.n_activated_experts"),
    "moe_intermediate_size": (HF, "model.moe.moe_inter_dim"),
    "routed_scaling_factor": (HF, "model.moe.route_scale"),
    "num_nextn_predict_layers": (HF, "model.mtp.depth"),
    "index_topk": (HF, "model.indexer.topk"),
    "index_n_heads": (HF, "model.indexer.n_heads"),
    "index_head_dim": (HF, "model.indexer.head_dim"),
    "rms_norm_eps": (HF, "model.norm_eps"),
    "qk_rope_head_dim": (HF, "model.rope_head_dim"),
    "rope_scaling": (HF, "model.rope.yarn"),
    "sliding_window": (HF, "model.window_size"),
    "hc_sinkhorn_iters": (HF, "model.mhc.sinkhorn_iters"),
    "hc_eps": (HF, "model.mhc.eps"),
    "initializer_range": (HF, "model.init_std"),
    # torchtitan (job config and MoE / DeepSeek model args)
    "num_experts": (TORCHTITAN, "model.moe.n_routed_experts"),
    "top_k": (TORCHTITAN, "model.moe.n_activated_experts"),
    "load_balance_coeff": (TORCHTITAN, "model.moe.bias_update_speed"),
    "max_seq_len": (TORCHTITAN, "model.max_position_embeddings"),
    "local_batch_size": (TORCHTITAN, "parallel.micro_batch_size"),
    "max_norm": (TORCHTITAN, "optimizer.grad_clip"),
    "decay_type": (TORCHTITAN, "optimizer.schedule"),
    "tensor_parallel_degree": (TORCHTITAN, "parallel.tp"),
    "pipeline_parallel_degree": (TORCHTITAN, "parallel.pp"),
    "context_parallel_degree": (TORCHTITAN, "parallel.cp"),
    "expert_parallel_degree": (TORCHTITAN, "parallel.ep"),
    "keep_latest_k": (TORCHTITAN, "checkpointing.keep_last"),
    "log_freq": (TORCHTITAN, "logging.interval_steps"),
    "enable_tensorboard": (TORCHTITAN, "logging.tensorboard"),
    "enable_wandb": (TORCHTITAN, "logging.wandb (a section: {project, name, mode})"),
}
"""Peer spelling → (whose name it is, our dotted path)."""

NO_EQUIVALENT: dict[str, tuple[str, str]] = {
    "moe_router_force_load_balancing": (MEGATRON, "a benchmarking switch that routes by random logits; the "
                                                  "bundled job always routes by score (hash layers by token id)"),
    "moe_router_load_balancing_type": (MEGATRON, "the V4 balance is fixed: the auxiliary-loss-free bias "
                                                 "(model.moe.bias_update_speed) plus the sequence-wise balance loss "
                                                 "(model.moe.balance_loss_alpha)"),
    "moe_token_dispatcher_type": (MEGATRON, "experts are always dispatched all-to-all over parallel.ep"),
    "moe_grouped_gemm": (MEGATRON, "the routed experts always run a grouped GEMM in bf16"),
    "sequence_parallel": (MEGATRON, "tensor parallelism is 1 in V4 (V4-TP-ONE); long sequences split over "
                                    "parallel.cp"),
    "moe_router_dtype": (MEGATRON, "the router scores in fp32 (the released model's choice)"),
    "use_flash_attn": (MEGATRON, "attention kernels are attention.kernel_backend (reference or triton)"),
}
"""Peer names with no setting here: (whose name it is, why none / what does the job instead)."""


def _normal(key: str) -> str:
    return key.strip().lstrip("-").split("=", 1)[0].lower().replace("-", "_")


def peer_name(key: str) -> tuple[str, str] | None:
    """(whose name, our path) when ``key`` (a YAML key or a ``--flag``) is a peer launcher's spelling of one of our
    fields."""
    return PEER_NAMES.get(_normal(key))


def peer_without_equivalent(key: str) -> tuple[str, str] | None:
    """(whose name, why there is none here) when ``key`` is a peer launcher's setting this product has no field for."""
    return NO_EQUIVALENT.get(_normal(key))
