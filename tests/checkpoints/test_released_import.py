"""Import of released-format checkpoints: exact dequantisation, strict names/shapes/dtypes, clear refusals.

Every imported tensor is compared with a float64 decoding of the stored bits written in
released_helpers.py (not the importer's codecs). Bad checkpoints must be refused with the tensor
and the shard file named, and leave nothing at --out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from ckpt_helpers import tiny_dict
from released_helpers import model_shapes, random_release, released_config, truth, write_release
from safetensors.torch import save_file

from v4launch.checkpoints.released_config import ReleasedCheckpointError, compare_with_recipe, read_config
from v4launch.checkpoints.released_import import import_released
from v4launch.errors import RefusedError
from v4launch.model import ModelArgs, V4Model
from v4launch.model.args import FLASH_COMPRESS_RATIOS
from v4launch.training.model_adapter import RECIPE_PATHS, model_args_from_recipe
from v4launch.training.released_init import load_released_init
from v4launch.validators.schema import Recipe


@pytest.fixture
def tiny():
    recipe = Recipe.model_validate(tiny_dict())
    return recipe, model_args_from_recipe(recipe)


def _release(tmp_path: Path, args: ModelArgs, recipe: Recipe, seed: int, **kw) -> tuple[Path, dict]:
    release = random_release(args, seed, **kw)
    src = tmp_path / "release"
    write_release(src, release, released_config(args, recipe.model.max_position_embeddings))
    return src, release


def _import(src: Path, out: Path, recipe: Recipe, args: ModelArgs):
    problems = compare_with_recipe(read_config(src), src / "config.json", args, RECIPE_PATHS,
                                   recipe.model.max_position_embeddings)
    return import_released(src, out, args, recipe_name=recipe.name, config_problems=problems)


def test_import_dequantises_every_tensor_exactly_and_runs_a_forward(tmp_path, tiny):
    recipe, args = tiny
    seed = int(torch.randint(0, 2**31 - 1, ()))
    src, release = _release(tmp_path, args, recipe, seed)
    record = _import(src, tmp_path / "imported", recipe, args)
    assert record.n_tensors == len(model_shapes(args)) and record.indexer_layers == [1, 3]
    assert record.storage["fp8"] > 0 and record.storage["fp4"] == 4 * 4 * 3 + 4 * 3  # 4 MoE layers + MTP, 4 experts
    model = V4Model(args, phase="sparse")
    load_released_init(model, tmp_path / "imported")
    for name, value in model.state_dict().items():
        want = truth(name, release)
        got = value.double() if value.is_floating_point() else value.long()
        assert torch.equal(got, want if want.is_floating_point() else want.long()), name
    tokens = torch.randint(0, 257, (96,))
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    out = model(tokens, cu, 56, labels=tokens.roll(-1))
    # the same model from the float64 truth cast to float32 gives the same loss
    ref = V4Model(args, phase="sparse")
    ref.load_state_dict({n: truth(n, release).to(v.dtype) for n, v in ref.state_dict().items()})
    assert torch.isfinite(out.lm_loss) and out.lm_loss.item() == ref(tokens, cu, 56, labels=tokens.roll(-1)).lm_loss.item()


def test_flash_shaped_checkpoint_names_and_shapes_are_checked_strictly(tmp_path):
    """All 43 + 1 layers of V4-Flash at tiny widths; the model's names are the released name patterns."""
    args = ModelArgs(vocab_size=96, dim=32, n_layers=43, n_mtp_layers=1, compress_ratios=FLASH_COMPRESS_RATIOS,
                     n_heads=2, head_dim=32, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32,
                     window_size=8, index_n_heads=2, index_head_dim=32, index_topk=4, n_routed_experts=2,
                     n_activated_experts=1, moe_inter_dim=32, n_hash_layers=3)
    shapes = model_shapes(args)
    patterns = {re.sub(r"experts\.\d+\.", "experts.0.", re.sub(r"^(layers|mtp)\.\d+\.", r"\1.0.", n)) for n in shapes}
    # the distinct name patterns of the released V4-Flash model.safetensors.index.json, weights only
    released = set(RELEASED_FLASH_PATTERNS)
    assert patterns == released
    assert sum(n.startswith("layers.") and n.endswith(".attn.indexer.wq_b.weight") for n in shapes) == 21
    assert sum(n.endswith("ffn.gate.tid2eid") for n in shapes) == 3
    release = random_release(args, 7)
    config = released_config(args, 65536)
    write_release(tmp_path / "flash", release, config, n_shards=4)
    record = import_released(tmp_path / "flash", tmp_path / "ok", args, recipe_name="flash_tiny")
    assert record.n_tensors == len(shapes) and len(record.indexer_layers) == 21
    # one shape off in one layer of 43: refused with the tensor and file named, nothing written
    bad = dict(release)
    bad["layers.41.attn.compressor.ape"] = torch.zeros(128, 33)
    write_release(tmp_path / "bad", bad, config, n_shards=4)
    with pytest.raises(ReleasedCheckpointError) as e:
        import_released(tmp_path / "bad", tmp_path / "out", args, recipe_name="flash_tiny")
    index = json.loads((tmp_path / "bad" / "model.safetensors.index.json").read_text())["weight_map"]
    assert (f"wrong shape: layers.41.attn.compressor.ape in {index['layers.41.attn.compressor.ape']} is [128, 33], "
            "the model needs [128, 32]") in e.value.message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


RELEASED_FLASH_PATTERNS = [  # weights (and F32/int tensors); the .scale names are checked with the formats
    "embed.weight", "hc_head_base", "hc_head_fn", "hc_head_scale", "head.weight", "norm.weight",
    "layers.0.attn.attn_sink", "layers.0.attn.compressor.ape", "layers.0.attn.compressor.norm.weight",
    "layers.0.attn.compressor.wgate.weight", "layers.0.attn.compressor.wkv.weight",
    "layers.0.attn.indexer.compressor.ape", "layers.0.attn.indexer.compressor.norm.weight",
    "layers.0.attn.indexer.compressor.wgate.weight", "layers.0.attn.indexer.compressor.wkv.weight",
    "layers.0.attn.indexer.weights_proj.weight", "layers.0.attn.indexer.wq_b.weight", "layers.0.attn.kv_norm.weight",
    "layers.0.attn.q_norm.weight", "layers.0.attn.wkv.weight", "layers.0.attn.wo_a.weight",
    "layers.0.attn.wo_b.weight", "layers.0.attn.wq_a.weight", "layers.0.attn.wq_b.weight",
    "layers.0.attn_norm.weight", "layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.0.w2.weight",
    "layers.0.ffn.experts.0.w3.weight", "layers.0.ffn.gate.bias", "layers.0.ffn.gate.tid2eid",
    "layers.0.ffn.gate.weight", "layers.0.ffn.shared_experts.w1.weight", "layers.0.ffn.shared_experts.w2.weight",
    "layers.0.ffn.shared_experts.w3.weight", "layers.0.ffn_norm.weight", "layers.0.hc_attn_base",
    "layers.0.hc_attn_fn", "layers.0.hc_attn_scale", "layers.0.hc_ffn_base", "layers.0.hc_ffn_fn",
    "layers.0.hc_ffn_scale", "mtp.0.attn.attn_sink", "mtp.0.attn.kv_norm.weight", "mtp.0.attn.q_norm.weight",
    "mtp.0.attn.wkv.weight", "mtp.0.attn.wo_a.weight", "mtp.0.attn.wo_b.weight", "mtp.0.attn.wq_a.weight",
    "mtp.0.attn.wq_b.weight", "mtp.0.attn_norm.weight", "mtp.0.e_proj.weight", "mtp.0.enorm.weight",
    "mtp.0.ffn.experts.0.w1.weight", "mtp.0.ffn.experts.0.w2.weight", "mtp.0.ffn.experts.0.w3.weight",
    "mtp.0.ffn.gate.bias", "mtp.0.ffn.gate.weight", "mtp.0.ffn.shared_experts.w1.weight",
    "mtp.0.ffn.shared_experts.w2.weight", "mtp.0.ffn.shared_experts.w3.weight", "mtp.0.ffn_norm.weight",
    "mtp.0.h_proj.weight", "mtp.0.hc_attn_base", "mtp.0.hc_attn_fn", "mtp.0.hc_attn_scale", "mtp.0.hc_ffn_base",
    "mtp.0.hc_ffn_fn", "mtp.0.hc_ffn_scale", "mtp.0.hc_head_base", "mtp.0.hc_head_fn", "mtp.0.hc_head_scale",
    "mtp.0.hnorm.weight", "mtp.0.norm.weight",
]


def _shard_of(src: Path, name: str) -> str:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite(src: Path, name: str, tensor: torch.Tensor | None) -> None:
    """Replace (or with None: drop) one tensor in its shard and the index."""
    from safetensors.torch import load_file

    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = index["weight_map"][name]
    tensors = load_file(str(src / file))
    if tensor is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = tensor
    save_file(tensors, str(src / file))
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("damage", ["missing_shard", "wrong_shape", "wrong_dtype", "missing_tensor",
                                    "unexpected_tensor", "wrong_scale_dtype", "nan_scale"])
def test_a_bad_checkpoint_is_refused_naming_the_tensor_and_the_file(tmp_path, tiny, damage):
    recipe, args = tiny
    src, release = _release(tmp_path, args, recipe, int(torch.randint(0, 1000, ())))
    name = "layers.2.attn.wq_b.weight"
    file = _shard_of(src, name)
    expect = {
        "missing_shard": f"missing shard file {src / file}",
        "wrong_shape": f"wrong shape: {name} in {file} is [64, 31], the model needs [64, 32]",
        "wrong_dtype": f"wrong dtype: {name} in {file} is F32; the released format stores it as F8_E4M3",
        "missing_tensor": f"missing tensor {name} (model shape [64, 32]): not in model.safetensors.index.json",
        "unexpected_tensor": f"unexpected tensor layers.2.attn.wq_c.weight in {file}",
        "wrong_scale_dtype": f"wrong dtype: layers.2.attn.wq_b.scale in {_shard_of(src, 'layers.2.attn.wq_b.scale')} "
                             "is F32; block scales are F8_E8M0",
        "nan_scale": f"{name} in {file}: holds NaN or infinite values after dequantisation",
    }[damage]
    if damage == "missing_shard":
        (src / file).unlink()
    elif damage == "wrong_shape":
        _rewrite(src, name, release[name].view(torch.uint8)[:, :31].contiguous().view(torch.float8_e4m3fn))
    elif damage == "wrong_dtype":
        _rewrite(src, name, torch.zeros(64, 32))
    elif damage == "missing_tensor":
        _rewrite(src, name, None)
    elif damage == "unexpected_tensor":
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"]["layers.2.attn.wq_c.weight"] = file
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
        _rewrite(src, "layers.2.attn.wq_c.weight", torch.zeros(2, 2))
    elif damage == "wrong_scale_dtype":
        _rewrite(src, "layers.2.attn.wq_b.scale", torch.ones(1, 1))
    elif damage == "nan_scale":
        _rewrite(src, "layers.2.attn.wq_b.scale", torch.full((1, 1), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    with pytest.raises(ReleasedCheckpointError) as e:
        _import(src, tmp_path / "out", recipe, args)
    assert expect in e.value.message
    assert e.value.hint
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_a_config_that_differs_from_the_recipe_names_every_field(tmp_path, tiny):
    recipe, args = tiny
    src, _ = _release(tmp_path, args, recipe, 3)
    config = json.loads((src / "config.json").read_text())
    config.update(compress_rope_theta=40000, moe_intermediate_size=128)
    config["rope_scaling"]["factor"] = 40
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleasedCheckpointError) as e:
        _import(src, tmp_path / "out", recipe, args)
    msg = e.value.message
    assert "(3 fields differ)" in msg
    assert "compress_rope_theta: config.json has 40000, the recipe's model.rope.compress_rope_theta = 160000.0" in msg
    assert "moe_intermediate_size: config.json has 128, the recipe's model.moe.moe_inter_dim = 64" in msg
    assert "rope_scaling.factor: config.json has 40, the recipe's model.rope.yarn.factor = 16.0" in msg
    del config["swiglu_limit"]
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleasedCheckpointError, match=r"quantization_config \{'weight_block_size': \[64, 64\]\}"):
        _import(src, tmp_path / "out", recipe, args)
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (src / "config.json").write_text(json.dumps(config))
    problems = compare_with_recipe(config, src / "config.json", args, RECIPE_PATHS, 65536)
    assert "config.json has no swiglu_limit (the recipe's model.moe.swiglu_limit = 10.0)" in problems


def test_init_from_released_refuses_what_it_cannot_load(tmp_path, tiny):
    recipe, args = tiny
    src, _ = _release(tmp_path, args, recipe, 5)
    with pytest.raises(RefusedError) as e:  # the released directory itself
        load_released_init(V4Model(args, phase="sparse"), src)
    assert "is a released-format directory" in e.value.message and "v4launch checkpoint import" in e.value.hint
    _import(src, tmp_path / "imp", recipe, args)
    with pytest.raises(RefusedError) as e:  # trained indexers, dense first stage
        load_released_init(V4Model(args, phase="dense"), tmp_path / "imp")
    assert "first stage's phase is dense" in e.value.message
    with pytest.raises(RefusedError) as e:  # another architecture
        load_released_init(V4Model(args.replace(swiglu_limit=7.0), phase="sparse"), tmp_path / "imp")
    assert "swiglu_limit: import 10.0, this run 7.0" in e.value.message


def test_import_holds_one_dequantised_tensor_at_a_time(tmp_path, tiny, monkeypatch):
    """Memory stays bounded by a tensor, not the model: when DCP asks for the next tensor, the ones it
    already wrote are gone (a file per rank would keep every tensor until the file is closed)."""
    import weakref

    from v4launch.checkpoints import released_import

    recipe, args = tiny
    src, _ = _release(tmp_path, args, recipe, 11)
    alive: list[weakref.ref] = []
    peak = []
    real = released_import.materialize

    def tracked(plan, reader, n_experts):
        peak.append(sum(r() is not None for r in alive))
        array = real(plan, reader, n_experts).numpy().copy()
        alive.append(weakref.ref(array))  # the array lives as long as any tensor sharing its memory
        return torch.from_numpy(array)

    monkeypatch.setattr(released_import, "materialize", tracked)
    _import(src, tmp_path / "imported", recipe, args)
    assert len(peak) == len(model_shapes(args)) and max(peak) <= 1


FLASH_CONFIG = {  # the values of the V4-Flash release's config.json (reference/v4-model-spec.md §1)
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
    "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                                     "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                            "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_the_released_flash_config_matches_the_flash_recipe_and_not_the_pro_one():
    from v4launch.recipe_loading import load_recipe

    for name, n_diff in (("flash", 0), ("pro", 10)):
        recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / f"{name}.yaml").recipe
        problems = compare_with_recipe(FLASH_CONFIG, Path("config.json"), model_args_from_recipe(recipe),
                                       RECIPE_PATHS, recipe.model.max_position_embeddings)
        assert len(problems) == n_diff, problems
    assert "hidden_size: config.json has 4096, the recipe's model.dim = 7168" in problems
