"""Helpers of the checkpoint tests: the embedded tiny recipe, V4-like param groups, manifests."""

from __future__ import annotations

from importlib import resources
from typing import Any

import torch
from omegaconf import OmegaConf

from v4launch.checkpoints import Manifest, describe_params
from v4launch.validators.schema import Recipe


def tiny_dict() -> dict[str, Any]:
    """The embedded tiny_cpu.yaml as a plain dict (mutate a copy, then ``Recipe.model_validate``)."""
    text = resources.files("v4launch.recipes").joinpath("tiny_cpu.yaml").read_text()
    return OmegaConf.to_container(OmegaConf.create(text), resolve=True)




def groups(indexer: bool = False, dtype: torch.dtype = torch.float32) -> dict[str, dict[str, Any]]:
    """Param-group summaries like a V4 model's: Muon matrices, AdamW rest (+ indexer params when built)."""
    muon = [("layers.0.attn.wq_a.weight", torch.zeros(2, 2, dtype=dtype)), ("layers.1.ffn.w1.weight", torch.zeros(2, 2))]
    adam = [("embed.weight", torch.zeros(2)), ("norm.weight", torch.zeros(2))]
    if indexer:
        muon.append(("layers.1.attn.indexer.wq_b.weight", torch.zeros(2, 2)))
    return {"muon": describe_params(muon), "adamw": describe_params(adam)}


PARALLEL = {"world": 1, "dp": 1, "cp": 1, "pp": 1, "tp": 1, "ep": 1}


def manifest_for(recipe: Recipe, stage_index: int = 0, **kw: Any) -> Manifest:
    """A complete manifest of ``recipe`` at ``stage_index`` (indexer params follow the stage's phase)."""
    phase = recipe.curriculum.stages[stage_index].phase
    args = dict(step=10, tokens_consumed=10240, parallel_sizes=PARALLEL, tokenizer_fingerprint="byte-utf8:v1:vocab=257:eod=256",
                param_groups=groups(indexer=phase != "dense"))
    args.update(kw)
    return Manifest.for_recipe(recipe, stage_index=stage_index, **args).replace(complete=True)
