"""Export of a run's checkpoint in the released format, and the round trips through import.

The quantisers are checked against a brute-force nearest-value search over every code of the
format (float64, decoders in released_helpers.py); the exported files' dtypes against the
storage table of spec §1; BF16 round trips exactly, FP8/FP4 within the format's rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import manifest_for, tiny_dict
from released_helpers import e2m1_f64, e4m3_f64, e8m0_f64, fp4_truth, fp8_truth, kind
from safetensors import safe_open

from v4launch.checkpoints.dcp import save_checkpoint
from v4launch.checkpoints.released_config import ReleasedCheckpointError
from v4launch.checkpoints.released_export import export_released
from v4launch.checkpoints.released_format import quantize_fp4, quantize_fp8
from v4launch.checkpoints.released_import import import_released
from v4launch.checkpoints.stateful import ModelState
from v4launch.model import V4Model
from v4launch.training.model_adapter import model_args_from_recipe
from v4launch.training.released_init import load_released_init
from v4launch.validators.schema import Recipe

E4M3_GRID = e4m3_f64(torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8))
E2M1_GRID = e2m1_f64(torch.arange(16))


def _weights(shape: tuple[int, int]) -> torch.Tensor:
    """Random weights whose rows and blocks span several orders of magnitude (and one all-zero row)."""
    w = torch.randn(shape, dtype=torch.float64) * torch.pow(10.0, torch.empty(shape[0], 1).uniform_(-4, 1).double())
    w[0] = 0.0
    return w.float()


def test_fp8_quantiser_picks_the_smallest_power_of_two_scale_and_the_nearest_code():
    w = _weights((200, 160)).double()
    codes, scale = quantize_fp8(w.float())
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 2)
    got = fp8_truth(codes, scale)
    s = e8m0_f64(scale)
    for i in range(2):
        for j in range(2):
            block = w.float().double()[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = block.abs().max()
            if amax > 0:  # smallest 2^k with amax / 2^k <= 448
                assert amax / s[i, j] <= 448 < amax / (s[i, j] / 2)
            grid = E4M3_GRID * s[i, j]
            best = (block.reshape(-1, 1) - grid).abs().min(dim=1).values.reshape(block.shape)
            err = (block - got[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).abs()
            assert torch.equal(err, best)


def test_fp4_quantiser_picks_the_smallest_power_of_two_scale_and_the_nearest_code():
    w = _weights((40, 96)).double()
    w[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, dtype=torch.float64)  # exact ties
    packed, scale = quantize_fp4(w.float())
    assert packed.dtype == torch.int8 and packed.shape == (40, 48) and scale.shape == (40, 3)
    got = fp4_truth(packed, scale)
    s = e8m0_f64(scale)
    for r in range(40):
        for b in range(3):
            x = w.float().double()[r, b * 32:(b + 1) * 32]
            amax = x.abs().max()
            if amax > 0:
                assert amax / s[r, b] <= 6 < amax / (s[r, b] / 2)
            best = (x.reshape(-1, 1) - E2M1_GRID * s[r, b]).abs().min(dim=1).values
            assert torch.equal((x - got[r, b * 32:(b + 1) * 32]).abs(), best)
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert got[1, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_fp4(torch.ones(4, 48))


@pytest.fixture
def run_with_checkpoint(tmp_path):
    """A run directory with one complete checkpoint (sparse phase: indexers built) of a random tiny model."""
    recipe = Recipe.model_validate(tiny_dict())
    args = model_args_from_recipe(recipe)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    model = V4Model(args, phase="sparse")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_checkpoint(tmp_path / "run" / "checkpoints", 7, {"model": ModelState(model)}, manifest_for(recipe, 2, step=7))
    return tmp_path / "run", recipe, args, model


def _import(src: Path, out: Path, args) -> dict[str, torch.Tensor]:
    import_released(src, out, args, recipe_name="tiny")
    model = V4Model(args, phase="sparse")
    load_released_init(model, out)
    return model.state_dict()


def test_bf16_export_reimports_exactly_and_is_stable(tmp_path, run_with_checkpoint):
    run, recipe, args, model = run_with_checkpoint
    result = export_released(run, tmp_path / "bf16", max_shard_bytes=60_000)
    assert result.step == 7 and result.n_files > 1 and not result.quantized
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "bf16").iterdir()}
    assert len(set(modes.values())) == 1, f"shards, index and config.json get the same permissions: {modes}"
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / "bf16" / file), "pt") as f:
            dtype = f.get_slice(name).get_dtype()
        assert dtype == {"f32": "F32", "index": "I32"}.get(kind(name), "BF16"), name
    first = _import(tmp_path / "bf16", tmp_path / "imp1", args)
    for name, value in model.state_dict().items():
        want = value if kind(name) in ("f32", "index") else value.to(torch.bfloat16).to(value.dtype)
        assert torch.equal(first[name], want), name
    # import -> run checkpoint -> export -> import gives the same tensors bit for bit
    reloaded = V4Model(args, phase="sparse")
    reloaded.load_state_dict(first)
    save_checkpoint(tmp_path / "run2" / "checkpoints", 8, {"model": ModelState(reloaded)},
                    manifest_for(recipe, 2, step=8))
    export_released(tmp_path / "run2", tmp_path / "bf16b")
    second = _import(tmp_path / "bf16b", tmp_path / "imp2", args)
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_quantized_export_reimports_within_the_format_rounding(tmp_path, run_with_checkpoint):
    run, _, args, model = run_with_checkpoint
    export_released(run, tmp_path / "q", step=7, quantize=True)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["expert_dtype"] == "fp4"
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.1.attn.wq_b.scale" in index and "layers.0.ffn.experts.3.w2.scale" in index
    got = _import(tmp_path / "q", tmp_path / "imp", args)
    for name, value in model.state_dict().items():
        w, deq = value.double(), got[name].double()
        k = kind(name)
        if k == "fp8":  # e4m3: 3 mantissa bits -> half a step is 2^-4 of the value (2^-10 scale below 2^-6)
            s = e8m0_f64(_stored_scale(tmp_path / "q", index, name)).repeat_interleave(128, 0)[:w.shape[0]]
            s = s.repeat_interleave(128, 1)[:, :w.shape[1]]
            assert ((w - deq).abs() <= torch.maximum(w.abs() * 2.0 ** -4, s * 2.0 ** -10)).all(), name
        elif k == "fp4":  # e2m1: half a step is at most 1/4 of the value (0.25 of the scale below 1)
            s = e8m0_f64(_stored_scale(tmp_path / "q", index, name)).repeat_interleave(32, 1)
            assert ((w - deq).abs() <= 0.25 * torch.maximum(w.abs(), s)).all(), name
        elif k in ("f32", "index"):
            assert torch.equal(got[name], value), name
        else:
            assert torch.equal(got[name], value.to(torch.bfloat16).to(value.dtype)), name
    assert any(not torch.equal(got[n], v) for n, v in model.state_dict().items() if kind(n) == "fp4")


def _stored_scale(directory: Path, index: dict, name: str) -> torch.Tensor:
    scale = name[:-6] + "scale"
    with safe_open(str(directory / index[scale]), "pt") as f:
        return f.get_tensor(scale)


def test_export_refuses_a_missing_step_and_an_existing_directory(tmp_path, run_with_checkpoint):
    run = run_with_checkpoint[0]
    with pytest.raises(ReleasedCheckpointError, match=r"no complete checkpoint step_00000003 \(complete: step_00000007\)"):
        export_released(run, tmp_path / "x", step=3)
    (tmp_path / "exists").mkdir()
    with pytest.raises(ReleasedCheckpointError, match="already exists"):
        export_released(run, tmp_path / "exists")
