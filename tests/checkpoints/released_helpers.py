"""Synthetic released-format checkpoints and an independent float64 decoder of their formats.

Nothing here calls ``v4launch.checkpoints.released_format``: the storage table, the bit layouts
(e4m3, e2m1 packed low nibble first, ue8m0, bf16) and the block scaling are written out again
from reference/v4-model-spec.md §1, so the importer is checked against a second reading.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from v4launch.model import ModelArgs, V4Model

FP8_NAMES = re.compile(r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|indexer\.wq_b\.weight$|shared_experts\.w\d\.weight$"
                       r"|(e_proj|h_proj)\.weight$")
FP4_NAMES = re.compile(r"\.experts\.\d+\.w\d\.weight$")
F32_LEAVES = {"attn_sink", "ape", "bias", "hc_attn_fn", "hc_ffn_fn", "hc_attn_base", "hc_ffn_base",
              "hc_attn_scale", "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale"}


def kind(name: str) -> str:
    """Storage of a tensor per spec §1 (written independently of the importer's table)."""
    if name.endswith("tid2eid"):
        return "index"
    if name.rsplit(".", 1)[-1] in F32_LEAVES:
        return "f32"
    if FP4_NAMES.search(name):
        return "fp4"
    if FP8_NAMES.search(name):
        return "fp8"
    return "bf16"


def model_shapes(args: ModelArgs, with_indexer: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of the bundled model's state dict (meta device)."""
    with torch.device("meta"):
        m = V4Model(args, phase="sparse" if with_indexer else "dense")
    return {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()}


# ------------------------------------------------------------------ float64 decoders from the bits
def e4m3_f64(raw: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes -> float64: sign, 4-bit exponent (bias 7), 3-bit mantissa; e=0 subnormal."""
    b = raw.view(torch.uint8).to(torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0).double()
    e, m = (b >> 3) & 0xF, (b & 7).double()
    normal = (1 + m / 8) * torch.pow(2.0, (e - 7).double())
    sub = (m / 8) * 2.0 ** -6
    return sign * torch.where(e == 0, sub, normal)


def e8m0_f64(raw: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> float64 2^(b-127)."""
    return torch.pow(2.0, raw.view(torch.uint8).to(torch.float64) - 127)


def e2m1_f64(nibble: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 -> float64: sign bit 3, 2-bit exponent (bias 1), 1-bit mantissa; e=0 subnormal."""
    n = nibble.to(torch.int64)
    sign = torch.where(n >= 8, -1.0, 1.0).double()
    e, m = (n >> 1) & 3, (n & 1).double()
    return sign * torch.where(e == 0, m * 0.5, (1 + m / 2) * torch.pow(2.0, (e - 1).double()))


def bf16_f64(raw: torch.Tensor) -> torch.Tensor:
    """bfloat16 -> float64 through its bits (the top half of a float32)."""
    bits = raw.view(torch.int16).to(torch.int32) << 16
    return bits.view(torch.float32).double()


def fp8_truth(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-dequantised FP8 weight in float64: every 128x128 block times its scale."""
    out = e4m3_f64(codes)
    s = e8m0_f64(scale)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= s[i, j]
    return out


def fp4_truth(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 weight [out, 2 * packed cols] in float64: byte j holds column 2j (low nibble) and 2j+1 (high)."""
    b = packed.view(torch.uint8).to(torch.int64)
    out = torch.empty(b.shape[0], 2 * b.shape[1], dtype=torch.float64)
    out[:, 0::2], out[:, 1::2] = e2m1_f64(b & 15), e2m1_f64(b >> 4)
    return out * e8m0_f64(scale).repeat_interleave(32, dim=1)


# ------------------------------------------------------------------ writing a synthetic release
def random_release(args: ModelArgs, seed: int, with_indexer: bool = True) -> dict[str, torch.Tensor]:
    """Released tensors (names as in the release, with .scale) of random content in the real formats."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, _) in model_shapes(args, with_indexer).items():
        k = kind(name)
        if k == "fp8":
            codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int64)
            codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # 0x7F / 0xFF are NaN in e4m3fn
            out[name] = codes.to(torch.uint8).view(torch.float8_e4m3fn)
            sshape = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
            out[name[:-6] + "scale"] = torch.randint(118, 126, sshape, generator=g).to(torch.uint8).view(
                torch.float8_e8m0fnu)
        elif k == "fp4":
            out[name] = torch.randint(0, 256, (shape[0], shape[1] // 2), generator=g).to(torch.uint8).view(torch.int8)
            out[name[:-6] + "scale"] = torch.randint(118, 126, (shape[0], shape[1] // 32), generator=g).to(
                torch.uint8).view(torch.float8_e8m0fnu)
        elif k == "index":
            out[name] = torch.rand(shape[0], args.n_routed_experts, generator=g).argsort(dim=1)[:, :shape[1]].to(
                torch.int32)
        else:
            value = 0.05 * torch.randn(shape, generator=g)
            if name.endswith("norm.weight") or name.endswith("_scale"):
                value = 1.0 + value
            out[name] = value if k == "f32" else value.to(torch.bfloat16)
    return out


def truth(name: str, release: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float64 value of model tensor ``name`` a released checkpoint stands for."""
    raw, k = release[name], kind(name)
    if k == "fp8" and raw.dtype == torch.float8_e4m3fn:
        return fp8_truth(raw, release[name[:-6] + "scale"])
    if k == "fp4" and raw.dtype == torch.int8:
        return fp4_truth(raw, release[name[:-6] + "scale"])
    if raw.dtype == torch.bfloat16:
        return bf16_f64(raw)
    return raw.double() if raw.is_floating_point() else raw


def write_release(directory: Path, release: dict[str, torch.Tensor], config: dict[str, Any], n_shards: int = 3) -> None:
    """Write ``release`` as ``n_shards`` safetensors files + model.safetensors.index.json + config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    names = list(release)
    weight_map = {}
    for i in range(n_shards):
        part = names[i::n_shards]
        file = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: release[n].contiguous() for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))


def released_config(args: ModelArgs, max_position_embeddings: int) -> dict[str, Any]:
    """A config.json in the released key style for ``args`` (as the V4-Flash release spells it)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_nextn_predict_layers": args.n_mtp_layers,
        "compress_ratios": list(args.compress_ratios), "num_attention_heads": args.n_heads,
        "head_dim": args.head_dim, "qk_rope_head_dim": args.rope_head_dim, "q_lora_rank": args.q_lora_rank,
        "o_groups": args.o_groups, "o_lora_rank": args.o_lora_rank, "sliding_window": args.window_size,
        "index_n_heads": args.index_n_heads, "index_head_dim": args.index_head_dim, "index_topk": args.index_topk,
        "rope_theta": args.rope_theta, "compress_rope_theta": args.compress_rope_theta,
        "rope_scaling": {"type": "yarn", "factor": args.rope_factor,
                         "original_max_position_embeddings": args.original_seq_len,
                         "beta_fast": args.beta_fast, "beta_slow": args.beta_slow},
        "n_routed_experts": args.n_routed_experts, "num_experts_per_tok": args.n_activated_experts,
        "n_shared_experts": args.n_shared_experts, "moe_intermediate_size": args.moe_inter_dim,
        "routed_scaling_factor": args.route_scale, "num_hash_layers": args.n_hash_layers,
        "swiglu_limit": args.swiglu_limit, "hc_mult": args.hc_mult, "hc_sinkhorn_iters": args.hc_sinkhorn_iters,
        "hc_eps": args.hc_eps, "rms_norm_eps": args.norm_eps, "scoring_func": "sqrtsoftplus",
        "num_key_value_heads": 1, "hidden_act": "silu", "tie_word_embeddings": False,
        "max_position_embeddings": max_position_embeddings, "initializer_range": 0.02, "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "expert_dtype": "fp4",
    }
