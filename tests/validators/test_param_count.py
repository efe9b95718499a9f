"""The validator's torch-free parameter list equals what the bundled model builds, entry by entry.

``validators.param_count`` is compared with ``V4Model.named_parameters()`` / ``named_buffers()`` for the
tiny recipe's model (both phases) and for freshly drawn small configurations: every non-expert FQN with
its exact element count, each layer's routed experts summed, every buffer with its element count and
dtype size, and the optimizer each parameter goes to (``v4launch.training.optim.group_kind``).
This test imports torch; ``v4launch validate`` never does.
"""

from __future__ import annotations

import random
import re

import pytest

torch = pytest.importorskip("torch")

from validate_helpers import RECIPES  # noqa: E402
from v4launch.model import V4Model  # noqa: E402
from v4launch.recipe_loading import load_recipe  # noqa: E402
from v4launch.training.model_adapter import model_args_from_recipe  # noqa: E402
from v4launch.training.optim import group_kind  # noqa: E402
from v4launch.validators.param_count import component_of, model_buffers, model_params  # noqa: E402
from v4launch.validators.schema import Recipe  # noqa: E402

EXPERT = re.compile(r"^(.*\.ffn\.experts)\.\d+\.w[123]\.weight$")


def _torch_side(recipe: Recipe, phase: str) -> tuple[dict[str, int], dict[str, str], dict[str, tuple[int, int]]]:
    """(numel per FQN with each layer's experts summed under '<prefix>.ffn.experts.*', optimizer kind
    per FQN, (numel, itemsize) per buffer) of the model the job builds."""
    torch.manual_seed(0)
    model = V4Model(model_args_from_recipe(recipe), phase=phase)
    numel: dict[str, int] = {}
    kind: dict[str, str] = {}
    for name, p in model.named_parameters():
        match = EXPERT.match(name)
        key = f"{match.group(1)}.*" if match else name
        numel[key] = numel.get(key, 0) + p.numel()
        k = group_kind(name, p, "muon_adamw")
        kind[key] = "muon" if k == "muon" else "adamw"
    buffers = {n: (b.numel(), b.element_size()) for n, b in model.named_buffers()}
    return numel, kind, buffers


def _compare(recipe: Recipe, phase: str) -> None:
    numel, kind, buffers = _torch_side(recipe, phase)
    specs = model_params(recipe.model, phase)
    assert {s.name: s.numel for s in specs} == numel
    assert {s.name: s.optimizer for s in specs} == kind
    assert {b.name: (b.numel, b.itemsize) for b in model_buffers(recipe.model)} == buffers
    assert sum(s.numel for s in specs) == sum(numel.values())


@pytest.mark.parametrize("phase", ["dense", "sparse"])
def test_tiny_recipe_model_matches_torch_exactly(phase: str):
    _compare(load_recipe(RECIPES / "tiny_cpu.yaml").recipe, phase)


def _random_model(rng: random.Random) -> dict:
    """A small valid model section drawn at random (ratios, hash layers, shared expert, MTP depth, widths)."""
    n_layers, depth = rng.randint(1, 5), rng.randint(0, 2)
    heads = rng.choice([1, 2, 4])
    groups = rng.choice([g for g in (1, 2, 4) if heads % g == 0])
    experts = rng.randint(1, 6)
    return {
        "vocab_size": rng.randint(257, 400), "dim": rng.choice([16, 24, 32]), "n_layers": n_layers,
        "compress_ratios": [rng.choice([0, 4, 128]) for _ in range(n_layers + depth)],
        "n_heads": heads, "head_dim": rng.choice([16, 32]), "rope_head_dim": 8, "q_lora_rank": rng.choice([8, 12, 16]),
        "o_groups": groups, "o_lora_rank": rng.choice([8, 12]), "window_size": 16,
        "indexer": {"n_heads": rng.choice([1, 2, 3]), "head_dim": rng.choice([8, 16]), "topk": 4},
        "moe": {"n_routed_experts": experts, "n_activated_experts": rng.randint(1, experts),
                "n_shared_experts": rng.randint(0, 1), "moe_inter_dim": rng.choice([8, 20]),
                "n_hash_layers": rng.randint(0, n_layers)},
        "mhc": {"hc_mult": rng.choice([1, 2, 4])}, "mtp": {"depth": depth},
    }


def test_random_models_match_torch_exactly():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(6):
        model = _random_model(rng)
        recipe = Recipe.model_validate({"name": "draw", "model": model,
                                        "curriculum": {"stages": [{"name": "s", "seq_len": 64, "steps": 1}]}})
        for phase in ("dense", "sparse"):
            try:
                _compare(recipe, phase)
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, model {model}, phase {phase}: {exc}") from None


def test_components_partition_the_flash_model():
    """Every Flash parameter falls in one named component and the components add up to the total
    (284.3B without the MTP layer: the released V4-Flash size)."""
    flash = load_recipe(RECIPES / "flash.yaml").recipe.model
    specs = model_params(flash, "sparse")
    assert {component_of(s.name) for s in specs} >= {"routed experts", "attention", "indexer", "mHC", "norms"}
    without_mtp = sum(s.numel for s in specs if s.holder != "m")
    assert round(without_mtp / 1e9, 1) == 284.3
