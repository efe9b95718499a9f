"""Import a released-format V4 checkpoint into a DCP checkpoint the training job starts from.

On disk (``out``)::

    out/
      .metadata, __0_*.distcp   torch.distributed.checkpoint, one key "model": FQN -> tensor in the
                                model's dtype (float32 weights, int32 tid2eid), exactly dequantised;
                                one file per tensor (DCP keeps a file's tensors until the file is
                                closed, so one file per rank would hold the whole model)
      config.json               the source's config.json, unchanged
      released_import.json      what was imported (:class:`ImportRecord`)

Steps: read ``model.safetensors.index.json`` and every shard's header (no tensor data), compare
``config.json`` with the recipe (``released_config.compare_with_recipe``), check every tensor name,
dtype and shape against the bundled ``V4Model`` built on the meta device (with indexers when the
source has them), and only then write. The writer dequantises one tensor at a time as DCP asks
for it (``_ReleasedSavePlanner.resolve_data``), so memory holds one tensor and its scales, never
the model (measured: a 418 MiB source with a 166 MB largest shard imports into 2.3 GiB of float32
at a peak of 380 MiB above the interpreter's own). Everything goes to ``out.tmp-<pid>`` first and is renamed into place: a failed import
leaves nothing behind.

Spec: reference/v4-model-spec.md §1 "Parameter dtypes"; the storage table is in
``released_format``. Source: torch.distributed.checkpoint ``SavePlanner.resolve_data`` (its
documented hook for transforming data as it is written).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from v4launch.model import ModelArgs, V4Model

from .released_config import CONFIG_NAME, INDEX_NAME, ReleasedCheckpointError, read_config
from .released_format import (SAFETENSORS_DTYPE, dequantize_fp4, dequantize_fp8, fp4_shapes, fp8_scale_shape,
                              scale_name, storage_of)

RECORD_NAME = "released_import.json"
RECORD_VERSION = 1
MAX_LISTED = 20
"""Problems listed one by one in an error (the count of the rest follows)."""


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a released checkpoint as its shard header describes it (no data read)."""

    name: str
    file: str
    dtype: str  # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorPlan:
    """How one model tensor is produced: its source weight, its scales (quantised only), its target."""

    fqn: str
    storage: str  # released_format.Storage
    weight: SourceTensor
    scale: SourceTensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class ImportRecord:
    """``released_import.json``: what an imported checkpoint holds and where it came from.

    Fields: version; source (absolute path of the released directory); model_args
    (``dataclasses.asdict(ModelArgs)`` of the recipe the import was checked against, compress_ratios
    as a list); phase ("sparse": CSA layers carry indexers, "dense": none in the source);
    indexer_layers (global ids); n_tensors (model tensors written); storage (storage kind -> count);
    source_bytes (bytes of the tensors read); recipe_name; seconds (wall time); created (Unix time).
    """

    source: str
    model_args: dict[str, Any]
    phase: str
    indexer_layers: list[int]
    n_tensors: int
    storage: dict[str, int]
    source_bytes: int
    recipe_name: str
    seconds: float = 0.0
    created: float = field(default_factory=time.time)
    version: int = RECORD_VERSION

    @classmethod
    def read(cls, directory: Path) -> "ImportRecord":
        """Read ``directory/released_import.json``.

        Raises:
            ReleasedCheckpointError: missing, unreadable, or of another version.
        """
        path = Path(directory) / RECORD_NAME
        try:
            data = json.loads(path.read_text())
            if data.get("version") != RECORD_VERSION:
                raise ValueError(f"version {data.get('version')!r}, this v4launch reads {RECORD_VERSION}")
            return cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise ReleasedCheckpointError(f"{path}: not a readable import record ({exc})",
                                          hint="import the released checkpoint again with `v4launch checkpoint "
                                               "import`") from None


# ------------------------------------------------------------------ reading the source
def read_index(directory: Path) -> dict[str, str]:
    """``weight_map`` of ``directory/model.safetensors.index.json``: tensor name -> shard file name.

    Raises:
        ReleasedCheckpointError: the directory, the index or its weight_map is missing or malformed.
    """
    directory = Path(directory)
    path = directory / INDEX_NAME
    if not directory.is_dir():
        raise ReleasedCheckpointError(f"{directory}: no such directory", hint="give the released checkpoint's directory")
    try:
        weight_map = json.loads(path.read_text()).get("weight_map")
    except FileNotFoundError:
        raise ReleasedCheckpointError(f"{path}: missing; a released checkpoint directory holds config.json, "
                                      f"{INDEX_NAME} and the shards it names",
                                      hint="point at the directory the release was downloaded into") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise ReleasedCheckpointError(f"{path}: cannot be read ({exc})", hint="restore the release's index file") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ReleasedCheckpointError(f"{path}: has no weight_map object of tensor name -> shard file",
                                      hint="restore the release's index file")
    return weight_map


def read_headers(directory: Path, weight_map: Mapping[str, str]) -> dict[str, SourceTensor]:
    """Every indexed tensor's dtype and shape from its shard's header (tensor data is not read).

    Raises:
        ReleasedCheckpointError: a shard file is missing or unreadable, or a tensor the index puts
            in a shard is not in it (the message names the tensors and the file).
    """
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    out: dict[str, SourceTensor] = {}
    for file, names in sorted(by_file.items()):
        path = Path(directory) / file
        if not path.is_file():
            raise ReleasedCheckpointError(
                f"missing shard file {path}: the index puts {len(names)} tensors in it ({_few(sorted(names))})",
                hint="download the missing shard again (every file named in the index must be present)")
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                absent = sorted(set(names) - keys)
                if absent:
                    raise ReleasedCheckpointError(f"shard {path} lacks {len(absent)} tensors the index puts in it "
                                                  f"({_few(absent)})", hint="the shard is truncated or from another "
                                                                            "release: download it again")
                for name in names:
                    s = f.get_slice(name)
                    out[name] = SourceTensor(name, file, s.get_dtype(), tuple(int(d) for d in s.get_shape()))
        except ReleasedCheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own SafetensorError for a damaged header
            raise ReleasedCheckpointError(f"shard {path} cannot be read as safetensors ({exc})",
                                          hint="download the shard again") from None
    return out


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f", … ({len(names) - 5} more)" if len(names) > 5 else "")


# ------------------------------------------------------------------ checking against the model
def model_tensors(args: ModelArgs, with_indexer: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """FQN -> (shape, dtype) of every parameter and buffer of ``V4Model(args)``, built on the meta device."""
    with torch.device("meta"):
        model = V4Model(args, phase="sparse" if with_indexer else "dense")
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def plan_import(args: ModelArgs, sources: Mapping[str, SourceTensor]) -> list[TensorPlan]:
    """Check ``sources`` strictly against the model of ``args``; return how to build each model tensor.

    The model has indexers when any source name contains ``.attn.indexer.``.

    Raises:
        ReleasedCheckpointError: every missing tensor, unexpected tensor, wrong dtype and wrong
            shape, each with the tensor's name and shard file (the first 20, then a count).
    """
    with_indexer = any(".attn.indexer." in n for n in sources)
    expected = model_tensors(args, with_indexer)
    problems: list[str] = []
    plans: list[TensorPlan] = []
    used: set[str] = set()
    for fqn, (shape, dtype) in expected.items():
        src = sources.get(fqn)
        if src is None:
            problems.append(f"missing tensor {fqn} (model shape {list(shape)}): not in {INDEX_NAME}")
            continue
        used.add(fqn)
        kind = storage_of(fqn)
        scale = sources.get(scale_name(fqn)) if kind in ("fp8", "fp4") else None
        if scale is not None:
            used.add(scale.name)
        problem = _check(kind, src, scale, shape)
        if problem:
            problems.append(problem)
        else:
            plans.append(TensorPlan(fqn, kind, src, scale, shape, dtype))
    problems += [f"unexpected tensor {n} in {s.file}: the model has no such parameter or buffer"
                 for n, s in sorted(sources.items()) if n not in used]
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  … and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise ReleasedCheckpointError(
            f"the released checkpoint does not match the recipe's model ({len(problems)} problems):\n  {listed}{more}",
            hint="check that config.json and the recipe's model: section describe the same model, and that the "
                 "shards are complete")
    return plans


_FORMS = {"fp8": "F8_E4M3 with an F8_E8M0 .scale [ceil(out/128), ceil(in/128)], or BF16 without a .scale",
          "fp4": "I8 (two e2m1 codes per byte) [out, in/2] with an F8_E8M0 .scale [out, in/32], or BF16 without "
                 "a .scale",
          "bf16": "BF16", "fp32": "F32", "index": "I32 (or I64)"}


def _check(kind: str, src: SourceTensor, scale: SourceTensor | None, shape: tuple[int, ...]) -> str | None:
    """What is wrong with one source tensor (and its scales), or None."""
    where = f"{src.name} in {src.file}"
    allowed = {"fp8": ("F8_E4M3", "BF16"), "fp4": ("I8", "BF16"), "bf16": ("BF16",), "fp32": ("F32",),
               "index": ("I32", "I64")}[kind]
    if src.dtype not in allowed:
        return f"wrong dtype: {where} is {src.dtype}; the released format stores it as {_FORMS[kind]}"
    quantised = src.dtype in ("F8_E4M3", "I8")
    want = fp4_shapes(shape)[0] if src.dtype == "I8" else shape
    if src.shape != tuple(want):
        return f"wrong shape: {where} is {list(src.shape)}, the model needs {list(want)}" + \
            (f" (packed from {list(shape)})" if src.dtype == "I8" else "")
    if not quantised:
        return None if scale is None else (f"unexpected tensor {scale.name} in {scale.file}: {src.name} is "
                                           f"{src.dtype}, which has no scales")
    if scale is None:
        return f"missing tensor {scale_name(src.name)}: the scales of the quantised {where}"
    want_scale = fp8_scale_shape(shape) if kind == "fp8" else fp4_shapes(shape)[1]
    if scale.dtype != "F8_E8M0":
        return f"wrong dtype: {scale.name} in {scale.file} is {scale.dtype}; block scales are F8_E8M0 (ue8m0)"
    if scale.shape != tuple(want_scale):
        return f"wrong shape: {scale.name} in {scale.file} is {list(scale.shape)}, the scales of {list(shape)} are " \
               f"{list(want_scale)}"
    return None


# ------------------------------------------------------------------ materialising
class ShardReader:
    """Reads single tensors from the shards of one directory; keeps the last two shards open."""

    def __init__(self, directory: Path, keep_open: int = 2):
        self.directory, self.keep_open = Path(directory), keep_open
        self._open: dict[str, Any] = {}
        self.bytes_read = 0

    def get(self, src: SourceTensor) -> torch.Tensor:
        """The tensor ``src`` as stored (e.g. float8_e4m3fn, int8, bfloat16)."""
        if src.file not in self._open:
            if len(self._open) >= self.keep_open:
                self._open.pop(next(iter(self._open))).__exit__(None, None, None)
            self._open[src.file] = safe_open(str(self.directory / src.file), framework="pt").__enter__()
        t = self._open[src.file].get_tensor(src.name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        """Close every open shard."""
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()


def materialize(plan: TensorPlan, reader: ShardReader, n_experts: int) -> torch.Tensor:
    """The model tensor of ``plan``: dequantised (exactly) and cast to the model's dtype.

    Raises:
        ReleasedCheckpointError: a NaN / infinite value (e.g. an e8m0 scale byte 255) or a
            ``tid2eid`` entry outside [0, n_experts); the message names the tensor and file.
    """
    raw = reader.get(plan.weight)
    if plan.scale is not None:
        scale = reader.get(plan.scale)
        value = dequantize_fp8(raw, scale) if plan.storage == "fp8" else dequantize_fp4(raw, scale)
    else:
        value = raw
    where = f"{plan.weight.name} in {plan.weight.file}"
    if plan.storage == "index":
        if value.numel() and (int(value.min()) < 0 or int(value.max()) >= n_experts):
            raise ReleasedCheckpointError(f"{where}: expert ids must lie in [0, {n_experts}), found "
                                          f"[{int(value.min())}, {int(value.max())}]",
                                          hint="the checkpoint was made for another number of routed experts")
    elif not bool(torch.isfinite(value).all()):
        raise ReleasedCheckpointError(f"{where}: holds NaN or infinite values after dequantisation",
                                      hint="the shard is damaged (or a scale byte is 255): download it again")
    return value.to(plan.dtype)


class _ReleasedSavePlanner(DefaultSavePlanner):
    """Plans the DCP save from meta tensors, then builds each tensor only when DCP writes it."""

    def __init__(self, plans: Mapping[str, TensorPlan], reader: ShardReader, n_experts: int):
        super().__init__()
        self.plans, self.reader, self.n_experts = plans, reader, n_experts

    def resolve_data(self, write_item):  # noqa: D102 (SavePlanner hook)
        fqn = write_item.index.fqn.removeprefix("model.")
        return materialize(self.plans[fqn], self.reader, self.n_experts)


@contextmanager
def unwrap_checkpoint_errors():
    """Re-raise the ReleasedCheckpointError DCP wrapped into its CheckpointException (a BaseException)."""
    try:
        yield
    except CheckpointException as exc:
        for inner, _trace in exc.failures.values():
            if isinstance(inner, ReleasedCheckpointError):
                raise inner from None
        raise ReleasedCheckpointError(f"torch.distributed.checkpoint failed: {str(exc).strip().splitlines()[-1]}",
                                      hint="check the checkpoint directory's files (disk space, permissions, "
                                           "truncated or missing .distcp files)") from None


# ------------------------------------------------------------------ the import
def import_released(source: Path, out: Path, args: ModelArgs, *, recipe_name: str,
                    config_problems: list[str] | None = None) -> ImportRecord:
    """Import the released checkpoint at ``source`` into ``out`` (see the module docstring).

    Args:
        source: directory with config.json, model.safetensors.index.json and the shards.
        out: new directory to create (must not exist).
        args: the recipe's model (``model_args_from_recipe``).
        recipe_name: recorded in ``released_import.json``.
        config_problems: config.json mismatches found by the caller (``compare_with_recipe``);
            any -> refused before anything is read.

    Raises:
        ReleasedCheckpointError: ``out`` exists, a config mismatch, any tensor problem
            (:func:`read_headers`, :func:`plan_import`, :func:`materialize`); nothing is left at ``out``.
    """
    source, out = Path(source).absolute(), Path(out).absolute()
    if out.exists():
        raise ReleasedCheckpointError(f"--out {out} already exists", hint="choose a new directory (or delete it)")
    if config_problems:
        raise ReleasedCheckpointError(
            f"{source / CONFIG_NAME} does not describe the recipe's model ({len(config_problems)} fields differ):\n  "
            + "\n  ".join(config_problems),
            hint="use the recipe that matches the release (e.g. recipes/flash.yaml), or change the named model.* fields")
    t0 = time.monotonic()
    config = read_config(source)
    sources = read_headers(source, read_index(source))
    plans = {p.fqn: p for p in plan_import(args, sources)}
    meta = {fqn: torch.empty(p.shape, dtype=p.dtype, device="meta") for fqn, p in plans.items()}
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    reader = ShardReader(source)
    try:
        with warnings.catch_warnings(), unwrap_checkpoint_errors():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": meta}, storage_writer=dcp.FileSystemWriter(str(tmp), single_file_per_rank=False),
                     planner=_ReleasedSavePlanner(plans, reader, args.n_routed_experts), no_dist=True)
        indexers = sorted({int(f.split(".")[1]) + (args.n_layers if f.startswith("mtp.") else 0)
                           for f in plans if ".attn.indexer." in f})
        record = ImportRecord(
            source=str(source), model_args=json.loads(json.dumps(dataclasses.asdict(args))),
            phase="sparse" if indexers else "dense", indexer_layers=indexers, n_tensors=len(plans),
            storage=dict(sorted(Counter(p.storage if p.scale is not None or p.storage not in ("fp8", "fp4")
                                        else "bf16" for p in plans.values()).items())),
            source_bytes=reader.bytes_read, recipe_name=recipe_name, seconds=round(time.monotonic() - t0, 3))
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / RECORD_NAME).write_text(json.dumps(dataclasses.asdict(record), indent=2, sort_keys=True) + "\n")
        os.rename(tmp, out)
        return record
    finally:
        reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
