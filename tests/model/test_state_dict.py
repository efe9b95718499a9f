"""Released checkpoint naming: key -> shape table written from the released inference/model.py
structure (after convert.py: no MTP copies of embed/head), independent of the model code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from v4_helpers import packed_batch, tiny_args
from v4launch.model import ModelArgs, V4Model

FLASH_CONFIG = {  # the released V4-Flash config.json (April release), HF key style
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4", "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
    "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8,
    "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
INFERENCE_CONFIG = {  # inference/config.json of the same release
    "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3, "n_heads": 64,
    "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64,
    "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "original_seq_len": 65536, "rope_theta": 10000,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "dtype": "fp8", "scale_fmt": "ue8m0",
    "expert_dtype": "fp4", "compress_rope_theta": 160000, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def released_shapes(a: ModelArgs, with_indexer: bool) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a dequantised released state dict, from the released module structure."""
    d, H, D, hc, E = a.dim, a.n_heads, a.head_dim, a.hc_mult, a.n_routed_experts
    mix = (2 + hc) * hc
    out = {"embed.weight": (a.vocab_size, d), "norm.weight": (d,), "head.weight": (a.vocab_size, d),
           "hc_head_fn": (hc, hc * d), "hc_head_base": (hc,), "hc_head_scale": (1,)}

    def block(p: str, layer_id: int) -> None:
        ratio = a.compress_ratios[layer_id]
        out.update({p + "attn.attn_sink": (H,), p + "attn.wq_a.weight": (a.q_lora_rank, d),
                    p + "attn.q_norm.weight": (a.q_lora_rank,), p + "attn.wq_b.weight": (H * D, a.q_lora_rank),
                    p + "attn.wkv.weight": (D, d), p + "attn.kv_norm.weight": (D,),
                    p + "attn.wo_a.weight": (a.o_groups * a.o_lora_rank, H * D // a.o_groups),
                    p + "attn.wo_b.weight": (d, a.o_groups * a.o_lora_rank),
                    p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,), p + "ffn.gate.weight": (E, d)})
        for comp, hd, r in ([("attn.compressor.", D, ratio)] if ratio else []) + (
                [("attn.indexer.compressor.", a.index_head_dim, 4)] if ratio == 4 and with_indexer else []):
            coff = 2 if r == 4 else 1
            out.update({p + comp + "ape": (r, coff * hd), p + comp + "wkv.weight": (coff * hd, d),
                        p + comp + "wgate.weight": (coff * hd, d), p + comp + "norm.weight": (hd,)})
        if ratio == 4 and with_indexer:
            out[p + "attn.indexer.wq_b.weight"] = (a.index_n_heads * a.index_head_dim, a.q_lora_rank)
            out[p + "attn.indexer.weights_proj.weight"] = (a.index_n_heads, d)
        if layer_id < a.n_hash_layers:
            out[p + "ffn.gate.tid2eid"] = (a.vocab_size, a.n_activated_experts)
        else:
            out[p + "ffn.gate.bias"] = (E,)
        experts = [f"ffn.experts.{e}." for e in range(E)] + (["ffn.shared_experts."] if a.n_shared_experts else [])
        for ex in experts:
            out.update({p + ex + "w1.weight": (a.moe_inter_dim, d), p + ex + "w2.weight": (d, a.moe_inter_dim),
                        p + ex + "w3.weight": (a.moe_inter_dim, d)})
        for sub in ("attn", "ffn"):
            out.update({f"{p}hc_{sub}_fn": (mix, hc * d), f"{p}hc_{sub}_base": (mix,), f"{p}hc_{sub}_scale": (3,)})

    for i in range(a.n_layers):
        block(f"layers.{i}.", i)
    for k in range(a.n_mtp_layers):
        p = f"mtp.{k}."
        block(p, a.n_layers + k)
        out.update({p + "e_proj.weight": (d, d), p + "h_proj.weight": (d, d), p + "enorm.weight": (d,),
                    p + "hnorm.weight": (d,), p + "norm.weight": (d,), p + "hc_head_fn": (hc, hc * d),
                    p + "hc_head_base": (hc,), p + "hc_head_scale": (1,)})
    return out


@pytest.mark.parametrize("phase", ["dense", "sparse"])
def test_tiny_model_keys_and_shapes_match_the_released_layout(phase):
    args = tiny_args()
    got = {k: tuple(v.shape) for k, v in V4Model(args, phase).state_dict().items()}
    assert got == released_shapes(args, with_indexer=phase != "dense")


def test_flash_keys_and_shapes_on_meta_device():
    args = ModelArgs.from_released_config(FLASH_CONFIG)
    with torch.device("meta"):
        model = V4Model(args, "sparse")
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = released_shapes(args, with_indexer=True)
    assert got == expected
    assert len(expected) > 30_000 and "mtp.0.embed.weight" not in got and "mtp.0.head.weight" not in got


def test_random_released_state_dict_loads_strictly_and_runs(gen):
    args = tiny_args()
    sd = {}
    for k, shape in released_shapes(args, with_indexer=True).items():
        if k.endswith("tid2eid"):
            sd[k] = torch.randint(0, args.n_routed_experts, shape, generator=gen, dtype=torch.int32)
        else:  # checkpoint dtypes: bf16 for most, fp32 for sink / ape / hc_* / bias
            fp32 = k.endswith(("attn_sink", "ape", "gate.bias")) or ".hc_" in k or k.startswith("hc_")
            sd[k] = (0.1 * torch.randn(shape, generator=gen)).to(torch.float32 if fp32 else torch.bfloat16)
    model = V4Model(args, "sparse")
    model.load_state_dict(sd, strict=True)
    out = model(*packed_batch([40, 150], args.vocab_size, gen), return_logits=True)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.lm_loss)


def test_from_released_config_both_key_styles():
    a, b = ModelArgs.from_released_config(FLASH_CONFIG), ModelArgs.from_released_config(INFERENCE_CONFIG)
    assert a == b == ModelArgs()  # defaults are the released Flash values
    assert a.compress_rope_theta == 160000 and a.original_seq_len == 65536 and a.rope_factor == 16
    assert a.compress_ratios.count(4) == 21 and len(a.compress_ratios) == 44
    with pytest.raises(ValueError, match="scoring_func"):
        ModelArgs.from_released_config({**FLASH_CONFIG, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="unknown released-config key"):
        ModelArgs.from_released_config({**FLASH_CONFIG, "new_field": 1})
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelArgs.from_released_config({**FLASH_CONFIG, "compress_ratios": [0, 4]})
