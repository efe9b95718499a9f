"""A released checkpoint's ``config.json`` against a recipe: read, compare field by field, write.

The keys are those of the released V4 ``config.json`` (Hugging Face style: ``hidden_size``,
``num_hidden_layers``, ``rope_scaling`` ...); ``ModelArgs.from_released_config`` turns them into
the model's arguments (it also reads ``inference/config.json`` keys). Every field that shapes
the model's tensors or its math must be in the file; ``initializer_range`` and the seed only
shape a fresh initialisation, which an import replaces, so they are not compared.

Spec: reference/v4-model-spec.md §1 (config) and §4 items 1 and 7 (the 160000
``compress_rope_theta`` of every released config; later checkpoints with other keys are refused,
not misread).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from v4launch.errors import V4LaunchError
from v4launch.model import ModelArgs
from v4launch.model.args import _KEY_MAP, _YARN_KEYS  # the released key names of ModelArgs fields

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"

NOT_COMPARED = ("init_std", "seed", "tie_word_embeddings")
"""ModelArgs fields a released config is not compared on: initialisation only (an import replaces
it), and the untied head ``ModelArgs`` already insists on."""

QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
"""``quantization_config`` of the released files (FP8 e4m3 weights, 128x128 ue8m0 block scales)."""


class ReleasedCheckpointError(V4LaunchError):
    """A released-format checkpoint that cannot be imported or written (message names tensor and file)."""


def released_key(field: str) -> str:
    """The released ``config.json`` key of ModelArgs ``field`` (``rope_scaling.<key>`` for YaRN)."""
    for key, name in _YARN_KEYS.items():
        if name == field:
            return f"rope_scaling.{key}"
    for key, name in _KEY_MAP.items():
        if name == field:
            return key
    return field


def read_config(directory: Path) -> dict[str, Any]:
    """``directory/config.json`` as a dict.

    Raises:
        ReleasedCheckpointError: missing or unparsable file.
    """
    if not Path(directory).is_dir():
        raise ReleasedCheckpointError(f"{directory}: no such directory",
                                      hint="pass the released checkpoint's directory (config.json, "
                                           "model.safetensors.index.json and the shards)")
    path = Path(directory) / CONFIG_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReleasedCheckpointError(f"{path}: no config.json in the released checkpoint directory",
                                      hint="copy the release's config.json beside model.safetensors.index.json") from None
    except (OSError, ValueError) as exc:
        raise ReleasedCheckpointError(f"{path}: cannot be read as JSON ({exc})",
                                      hint="restore the release's config.json") from None
    if not isinstance(data, dict):
        raise ReleasedCheckpointError(f"{path}: holds {type(data).__name__}, not a JSON object",
                                      hint="restore the release's config.json")
    return data


def config_args(config: Mapping[str, Any], source: Path) -> tuple[ModelArgs, set[str]]:
    """(ModelArgs of ``config``, the fields ``config`` sets). ``use_hadamard`` absent = True (released code).

    Raises:
        ReleasedCheckpointError: an unknown key, a value V4 does not support, an invalid
            ``quantization_config`` or ``expert_dtype``; the message names the key and the file.
    """
    _check_quantization(config, source)
    try:
        args = ModelArgs.from_released_config(config)
    except (ValueError, TypeError, AttributeError) as exc:  # AttributeError: a section that is not an object
        raise ReleasedCheckpointError(f"{source}: {exc}", hint="this v4launch reads the April DeepSeek-V4 release's "
                                      "config.json keys (reference/v4-model-spec.md §1)") from None
    present = {f.name for f in dataclasses.fields(ModelArgs)
               if released_key(f.name).split(".")[-1] in _flat_keys(config) or f.name in config}
    return args, present | {"use_hadamard"}


def _flat_keys(config: Mapping[str, Any]) -> set[str]:
    keys = set(config)
    scaling = config.get("rope_scaling") or {}
    return keys | {k for k in scaling if isinstance(scaling, Mapping)}


def _check_quantization(config: Mapping[str, Any], source: Path) -> None:
    quant = config.get("quantization_config")
    if quant is not None:
        bad = {k: quant.get(k) for k, v in QUANTIZATION.items() if quant.get(k) != v} if isinstance(quant, Mapping) \
            else {"quantization_config": quant}
        if bad:
            raise ReleasedCheckpointError(
                f"{source}: quantization_config {bad} is not the released format {QUANTIZATION}",
                hint="only FP8 e4m3 weights with 128x128 ue8m0 block scales (and FP4 experts) are read")
    expert = config.get("expert_dtype", "fp4")
    if expert not in ("fp4", "bf16"):
        raise ReleasedCheckpointError(f"{source}: expert_dtype={expert!r} is not read by this importer",
                                      hint="routed experts must be FP4 (e2m1 with 1x32 ue8m0 scales) or BF16")


def compare_with_recipe(config: Mapping[str, Any], source: Path, recipe_args: ModelArgs,
                        recipe_paths: Mapping[str, str], max_position_embeddings: int) -> list[str]:
    """Every difference between ``config`` and the recipe, one line each (field, both values, both names).

    Args:
        config: the released config.json.
        source: its path (named in the lines).
        recipe_args: ``model_args_from_recipe(recipe)``.
        recipe_paths: ModelArgs field -> recipe path (``model_adapter.RECIPE_PATHS``).
        max_position_embeddings: the recipe's ``model.max_position_embeddings``.

    Raises:
        ReleasedCheckpointError: the config itself is not a V4 config (``config_args``).
    """
    args, present = config_args(config, source)
    lines = []
    for f in dataclasses.fields(ModelArgs):
        if f.name in NOT_COMPARED:
            continue
        mine = getattr(recipe_args, f.name)
        key = released_key(f.name)
        if f.name not in present:
            lines.append(f"{source.name} has no {key} (the recipe's {recipe_paths[f.name]} = {_show(mine)})")
            continue
        theirs = getattr(args, f.name)
        if theirs != mine:
            why = (" (every released V4 config says 160000; 40000 is only a dataclass default, spec §4 item 1)"
                   if f.name == "compress_rope_theta" else "")
            lines.append(f"{key}: {source.name} has {_show(theirs)}, the recipe's {recipe_paths[f.name]} = "
                         f"{_show(mine)}{why}")
    if "max_position_embeddings" in config and config["max_position_embeddings"] != max_position_embeddings:
        lines.append(f"max_position_embeddings: {source.name} has {config['max_position_embeddings']}, the recipe's "
                     f"model.max_position_embeddings = {max_position_embeddings}")
    return lines


def _show(value: Any) -> str:
    return "[" + ", ".join(str(v) for v in value) + "]" if isinstance(value, tuple) else repr(value)


def config_for_export(args: ModelArgs, max_position_embeddings: int, *, quantized: bool) -> dict[str, Any]:
    """A released-style ``config.json`` for ``args`` (read back by :func:`config_args`).

    ``quantized``: the file also carries ``quantization_config`` and ``expert_dtype: fp4``;
    otherwise every weight is BF16 (``expert_dtype: bf16``).
    """
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                           "torch_dtype": "bfloat16", "attention_bias": False, "hidden_act": "silu",
                           "num_key_value_heads": 1, "norm_topk_prob": True, "scoring_func": "sqrtsoftplus",
                           "tie_word_embeddings": False, "max_position_embeddings": max_position_embeddings,
                           "rope_scaling": {"type": "yarn"}}
    for f in dataclasses.fields(ModelArgs):
        if f.name in ("seed", "tie_word_embeddings") or (f.name == "use_hadamard" and args.use_hadamard):
            continue
        key, value = released_key(f.name), getattr(args, f.name)
        value = list(value) if isinstance(value, tuple) else value
        if key.startswith("rope_scaling."):
            out["rope_scaling"][key.split(".", 1)[1]] = value
        else:
            out[key] = value
    if quantized:
        out["quantization_config"] = {**QUANTIZATION, "activation_scheme": "dynamic"}
        out["expert_dtype"] = "fp4"
    else:
        out["expert_dtype"] = "bf16"
    return out
