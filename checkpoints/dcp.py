"""torch.distributed.checkpoint implementation of the checkpoint contract, atomic on a shared filesystem.

On disk (``ckpt_root`` is a run's ``checkpoints/`` directory)::

    ckpt_root/
      step_00000040/          complete: DCP shards + .metadata + manifest.json (complete: true)
        __0_0.distcp          one file per saving rank (DCP FileSystemWriter)
        .metadata             DCP's global plan (tensor chunks, so another world size can reshard)
        manifest.json         ``base.Manifest``
      .tmp-step_00000060/     a save in progress, or one killed mid-way: ignored, removed by the next save

A save writes into ``.tmp-step_{step:08d}``; after every rank has finished
(``dcp.save`` ends collectively, then a barrier) rank 0 writes manifest.json
(fsync) and renames the directory to ``step_{step:08d}`` (atomic on POSIX), then
fsyncs ``ckpt_root``. A reader therefore sees either the whole checkpoint or none
of it. Works on CPU and GPU, with an initialised process group (any backend) or
without one (single process: DCP's ``no_dist`` mode).

Sources: torch.distributed.checkpoint (``save``/``load``, ``FileSystemWriter``),
torchtitan ``components/checkpointer/dcp.py`` (highest valid ``step-N``, keep-latest-k).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .base import MANIFEST_NAME, STATE_KEYS, CheckpointError, Manifest
from .listing import is_complete, latest_checkpoint, list_checkpoints, step_dir_name

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextmanager
def _quiet_no_dist():
    """DCP warns on every single-process save/load that it assumes one process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_keys(states: dict[str, Any]) -> None:
    unknown = sorted(set(states) - set(STATE_KEYS))
    if unknown:
        raise CheckpointError(f"checkpoint state keys {unknown} are not part of the contract; allowed: {list(STATE_KEYS)}")


def _write_manifest(directory: Path, manifest: Manifest) -> None:
    path = directory / MANIFEST_NAME
    with open(path, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def _clean_tmp(root: Path) -> None:
    for p in root.glob(TMP_PREFIX + "*"):
        log.info("removing unfinished checkpoint %s", p)
        shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(ckpt_root: Path, step: int, states: dict[str, Any], manifest: Manifest, *, keep_last: int | None = None) -> Path:
    """Save ``states`` (keys from ``STATE_KEYS``) and ``manifest`` as ``ckpt_root/step_{step:08d}``, atomically.

    Call on every rank (collective when a process group is initialised). Each
    value is a ``Stateful`` (its ``state_dict()`` is saved) or a plain dict of
    tensors / picklable values; tensors may be DTensors (sharded saves).

    Args:
        ckpt_root: directory of the run's checkpoints (created if missing).
        step: optimizer steps completed; names the directory.
        states: subset of ``STATE_KEYS`` → state.
        manifest: written with ``complete=True`` once all shards are on disk.
        keep_last: if given, prune older complete checkpoints after the save (``prune``).

    Returns:
        The final directory ``ckpt_root/step_{step:08d}``.

    Raises:
        CheckpointError: a key outside ``STATE_KEYS``.
        OSError: the filesystem refused a write or rename.
    """
    _check_keys(states)
    root = Path(ckpt_root)
    final = root / step_dir_name(step)
    tmp = root / (TMP_PREFIX + final.name)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _clean_tmp(root)
        tmp.mkdir()
    _barrier()
    with _quiet_no_dist():
        dcp.save(dict(states), storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=not _distributed())
    _barrier()
    if _rank() == 0:
        _write_manifest(tmp, manifest.replace(complete=True))
        if final.exists():  # re-saving a step (e.g. after a resume): the new copy replaces the old one
            old = root / (TMP_PREFIX + "old-" + final.name)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        if keep_last is not None:
            prune(root, keep_last)
    _barrier()
    return final


def load_checkpoint(path: Path, states: dict[str, Any]) -> Manifest:
    """Load the checkpoint at ``path`` into ``states`` in place and return its manifest.

    Call on every rank. ``states`` gives the target layout (current model,
    optimizer, …; keys from ``STATE_KEYS``): DCP reads only what each rank needs,
    so the current world size, DP/CP/PP sizes and DTensor sharding may differ from
    the saving run's. Stateful values get ``load_state_dict`` called; plain dicts are
    updated in place. Checking that the resume is allowed is ``compat.check_resume``'s job.

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint, a key is outside the contract, or its
            shard files cannot be read (truncated, missing); the hint names the fallback checkpoint.
    """
    _check_keys(states)
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (needs a step_* directory with .metadata and manifest.json complete=true)",
            hint=f"use the newest complete one: {latest_checkpoint(path.parent) or 'none found'}",
        )
    manifest = Manifest.read(path)
    try:
        with _quiet_no_dist():
            dcp.load(states, storage_reader=dcp.FileSystemReader(str(path)), no_dist=not _distributed())
    except (CheckpointException, OSError, EOFError) as exc:  # DCP's exception derives from BaseException
        older = [p for p in list_checkpoints(path.parent) if p != path]
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        missing = re.search(r"Missing key in checkpoint state_dict: ([\w.]+?)\.?$", first)
        if missing:  # the files are fine: the state asked for holds a tensor the checkpoint never had
            raise CheckpointError(
                f"checkpoint {path} has no tensor {missing.group(1)}, which the model being loaded has: the recipe "
                "adds parameters the checkpoint was not saved with (more layers, another layer schedule); the "
                "checkpoint itself is intact",
                hint="resume with the recipe the checkpoint was saved with (`v4launch resume RUN --recipe ...` or "
                     "without overrides), or start a new run with `v4launch run`") from None
        hint = (f"resume from another complete checkpoint, e.g. `v4launch resume {path.parent.parent} --checkpoint "
                f"{older[-1].name}` (the ones after the checkpoint you pick are set aside)" if older else
                f"no other complete checkpoint exists; move it aside (`mv '{path}' "
                f"'{path.parent}/damaged-{path.name}'`) and start the run again")
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({first}); its shard files are damaged or incomplete", hint=hint,
        ) from None
    return manifest


def prune(ckpt_root: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the ``keep_last`` newest; incomplete ones are left alone.

    Call on rank 0 only (``save_checkpoint(keep_last=...)`` does). Returns the deleted paths.

    Raises:
        ValueError: ``keep_last`` < 1.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    doomed = list_checkpoints(ckpt_root)[:-keep_last]
    for p in doomed:
        log.info("pruning checkpoint %s", p)
        shutil.rmtree(p)
    return doomed


class DCPStorage:
    """``base.CheckpointStorage`` over one directory with torch.distributed.checkpoint."""

    def __init__(self, ckpt_root: Path):
        self.root = Path(ckpt_root)

    def save(self, step: int, states: dict[str, Any], manifest: Manifest) -> Path:
        """``save_checkpoint(self.root, ...)``."""
        return save_checkpoint(self.root, step, states, manifest)

    def load(self, path: Path, states: dict[str, Any]) -> Manifest:
        """``load_checkpoint(path, states)``."""
        return load_checkpoint(path, states)

    def latest(self) -> Path | None:
        """``latest_checkpoint(self.root)``."""
        return latest_checkpoint(self.root)

    def prune(self, keep_last: int) -> list[Path]:
        """``prune(self.root, keep_last)``."""
        return prune(self.root, keep_last)
