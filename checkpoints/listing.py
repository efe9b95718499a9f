"""Which checkpoints a run has, from the filesystem alone (no torch): ``v4launch status`` and the
launchers list checkpoints in well under a second.

A complete checkpoint is a ``step_{step:08d}`` directory holding DCP's ``.metadata`` and a
``manifest.json`` whose ``complete`` is true (``dcp.save_checkpoint`` writes both, then renames the
directory into place). Layout: docs/checkpoints.md.
"""

from __future__ import annotations

import re
from pathlib import Path

from .base import CheckpointError, Manifest

STEP_DIR = re.compile(r"^step_(\d{8,})$")
METADATA_NAME = ".metadata"
# A rollback (``v4launch resume --checkpoint``) renames the newer checkpoints with this prefix: kept,
# never a ``step_*`` name, so never taken for the latest.
SET_ASIDE_PREFIX = "abandoned-"


def step_dir_name(step: int) -> str:
    """``step_{step:08d}``: the directory name of a complete checkpoint."""
    return f"step_{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """The step a ``step_*`` directory name records (``step_00000120`` -> 120), else None."""
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_complete(path: Path) -> bool:
    """True if ``path`` is a ``step_*`` directory with DCP ``.metadata`` and a manifest whose ``complete`` is true."""
    path = Path(path)
    if not STEP_DIR.match(path.name) or not (path / METADATA_NAME).is_file():
        return False
    try:
        return Manifest.read(path).complete
    except CheckpointError:
        return False


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under ``ckpt_root``, oldest step first (incomplete and ``.tmp-*`` skipped)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if is_complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``ckpt_root``, or None if there is none."""
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def list_set_aside(ckpt_root: Path) -> list[str]:
    """Names of the checkpoint directories a rollback set aside under ``ckpt_root``, sorted."""
    root = Path(ckpt_root)
    return sorted(p.name for p in root.glob(f"{SET_ASIDE_PREFIX}*")) if root.is_dir() else []
