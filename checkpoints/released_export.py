"""Export a run's checkpoint as a released-format V4 checkpoint (safetensors shards + index + config.json).

Output (``out``)::

    out/
      config.json                        released-style keys (``released_config.config_for_export``)
      model.safetensors.index.json       {"metadata": {"total_size": bytes}, "weight_map": name -> shard}
      model-00001-of-0000N.safetensors   shards of at most ``max_shard_bytes`` (a larger tensor gets its own)

Tensor names are the model's FQNs (the released names). Without ``quantize`` every weight is BF16
except the tensors the release keeps in F32 (``attn_sink``, ``ape``, ``hc_*``, ``gate.bias``) and
``tid2eid`` (I32): the run's float32 weights rounded to BF16 once. With ``quantize`` the FP8 and
FP4 tensors of the storage table (``released_format``) are quantised in the released formats with
their ``.scale`` tensors. ``import_released`` reads both. The DCP checkpoint is read one shard's
worth of tensors at a time (``dcp.load`` of a subset of keys), so memory holds one output shard.
Written into ``out.tmp-<pid>`` and renamed into place.

Spec: reference/v4-model-spec.md §1 "Parameter dtypes"; the released index layout (``metadata.total_size``,
``weight_map``) as in the V4 release.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from safetensors.torch import save_file

from .base import Manifest
from .listing import latest_checkpoint, list_checkpoints, step_dir_name
from .released_config import CONFIG_NAME, INDEX_NAME, ReleasedCheckpointError, config_for_export
from .released_format import quantize_fp4, quantize_fp8, scale_name, storage_of
from .released_import import model_tensors, unwrap_checkpoint_errors

DEFAULT_SHARD_BYTES = 4 << 30
"""Released shards are ~3.5 GB; 4 GiB keeps a Flash export at a similar count."""


@dataclass(frozen=True)
class ExportResult:
    """What ``export_released`` wrote: out (directory), checkpoint (the step directory read), step,
    n_tensors (model tensors), n_files (shards), total_bytes (tensor bytes written), quantized."""

    out: Path
    checkpoint: Path
    step: int
    n_tensors: int
    n_files: int
    total_bytes: int
    quantized: bool


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """``run_dir/checkpoints/step_<step>`` (the latest complete one when ``step`` is None).

    Raises:
        ReleasedCheckpointError: no complete checkpoint, or none at ``step`` (the message lists the steps there are).
    """
    root = Path(run_dir) / "checkpoints"
    path = latest_checkpoint(root) if step is None else root / step_dir_name(step)
    have = [p.name for p in list_checkpoints(root)]
    if path is None or path not in list_checkpoints(root):
        what = "no complete checkpoint" if step is None else f"no complete checkpoint {step_dir_name(step)}"
        raise ReleasedCheckpointError(f"run {run_dir}: {what} (complete: {', '.join(have) or 'none'})",
                                      hint="pick one of the listed steps with --step, or train the run further")
    return path


def _stored(name: str, tensor: torch.Tensor, quantize: bool) -> dict[str, torch.Tensor]:
    """The released tensors of one model tensor: itself in its released dtype (and its ``.scale``)."""
    kind = storage_of(name)
    if kind == "fp32":
        return {name: tensor.to(torch.float32).contiguous()}
    if kind == "index":
        return {name: tensor.to(torch.int32).contiguous()}
    if quantize and kind in ("fp8", "fp4"):
        codes, scale = quantize_fp8(tensor) if kind == "fp8" else quantize_fp4(tensor)
        return {name: codes.contiguous(), scale_name(name): scale.contiguous()}
    return {name: tensor.to(torch.bfloat16).contiguous()}


def _stored_bytes(shape: tuple[int, ...], kind: str, quantize: bool) -> int:
    n = 1
    for d in shape:
        n *= d
    if kind == "fp32" or kind == "index":
        return 4 * n
    if quantize and kind == "fp8":
        return n + (-(-shape[0] // 128)) * (-(-shape[1] // 128))
    if quantize and kind == "fp4":
        return n // 2 + n // 32
    return 2 * n


def _umask_mode() -> int:
    """The mode an ordinary new file gets under this process's umask (read by setting it back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def export_released(run_dir: Path, out: Path, *, step: int | None = None, quantize: bool = False,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> ExportResult:
    """Write the model of a run's checkpoint to ``out`` in the released format (module docstring).

    Args:
        run_dir: the run directory (``runs/<run>``).
        out: new directory (must not exist).
        step: checkpoint step; None = the latest complete one.
        quantize: FP8 / FP4 tensors in the released quantised formats (else BF16).
        max_shard_bytes: tensor bytes per shard file.

    Raises:
        ReleasedCheckpointError: ``out`` exists, no such checkpoint, a checkpoint whose model
            tensors differ from its recipe's model, an FP4 weight whose input width is not a
            multiple of 32 (with ``quantize``); nothing is left at ``out``.
    """
    from v4launch.training.model_adapter import model_args_from_recipe
    from v4launch.validators.schema import Recipe

    out = Path(out).absolute()
    if out.exists():
        raise ReleasedCheckpointError(f"{out} already exists", hint="choose a new output directory (or delete it)")
    ckpt = find_checkpoint(run_dir, step)
    manifest = Manifest.read(ckpt)
    try:
        recipe = Recipe.model_validate(manifest.recipe)
    except ValidationError:
        raise ReleasedCheckpointError(f"checkpoint {ckpt}: its manifest holds no complete recipe (written by an "
                                      "older v4launch), so the model to export is unknown",
                                      hint="export a checkpoint written by this v4launch version") from None
    args = model_args_from_recipe(recipe)
    expected = model_tensors(args, with_indexer=bool(manifest.indexer_layers))
    stored = _checkpoint_model_keys(ckpt)
    if set(stored) != set(expected):
        missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
        raise ReleasedCheckpointError(f"checkpoint {ckpt}: its model tensors differ from its recipe's model "
                                      f"(missing {missing[:5]}, unexpected {extra[:5]})",
                                      hint="export a checkpoint written by this v4launch version")
    if quantize:
        for name, (shape, _) in expected.items():
            if storage_of(name) == "fp4" and shape[1] % 32:
                raise ReleasedCheckpointError(f"{name}: shape {list(shape)} cannot be stored as FP4 (1x32 blocks need "
                                              "an input width divisible by 32)", hint="export without --quantize")
    shards = _group(expected, quantize, max_shard_bytes)
    file_mode = _umask_mode()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weight_map, total = {}, 0
        for i, names in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            target = {n: torch.empty(expected[n][0], dtype=expected[n][1]) for n in names}
            with warnings.catch_warnings(), unwrap_checkpoint_errors():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"model": target}, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
            tensors: dict[str, torch.Tensor] = {}
            for n in names:
                tensors.update(_stored(n, target.pop(n), quantize))
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            os.chmod(tmp / file, file_mode)  # safetensors writes 0600; the index and config.json follow the umask
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({n: file for n in tensors})
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
        config = config_for_export(args, recipe.model.max_position_embeddings, quantized=quantize)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, ckpt, manifest.step, len(expected), len(shards), total, quantize)


def _checkpoint_model_keys(ckpt: Path) -> list[str]:
    """Model FQNs a DCP checkpoint holds (its ``.metadata``, key ``model.<fqn>``)."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    return [k.removeprefix("model.") for k in meta.state_dict_metadata if k.startswith("model.")]


def _group(expected: dict[str, tuple[tuple[int, ...], torch.dtype]], quantize: bool, limit: int) -> list[list[str]]:
    """Model tensors in order, cut into shards of at most ``limit`` stored bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, _) in expected.items():
        n = _stored_bytes(shape, storage_of(name), quantize)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards
