"""`v4launch status` lists checkpoints from the filesystem alone: torch stays unloaded (it costs seconds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFEST = dict(recipe_name="tiny_cpu", recipe_hash="h", stage_index=0, stage_name="s0", phase="dense", step=0,
                tokens_consumed=0, compress_ratios=(0, 4), n_layers=2, n_mtp_layers=0, layer_ids=(0, 1),
                indexer_layers=(1,), param_groups={}, parallel={"dp": 1}, tokenizer="byte", torch_version="2.11")


def write_checkpoint(root: Path, name: str, *, metadata: bool = True, complete: bool = True, step: int = 0) -> Path:
    """A checkpoint directory as ``dcp.save_checkpoint`` leaves it (empty DCP ``.metadata``)."""
    from v4launch.checkpoints.base import Manifest

    path = root / name
    path.mkdir(parents=True)
    if metadata:
        (path / ".metadata").write_bytes(b"")
    (path / "manifest.json").write_text(Manifest(**{**MANIFEST, "step": step, "complete": complete}).to_json())
    return path

CHECK = r"""
import sys
sys.path.insert(0, {tests!r})
from typer.testing import CliRunner
from v4launch.cli import app
from v4launch.rundir import create_run_dir
from v4launch.training.recipe_io import load_recipe
from test_listing_no_torch import write_checkpoint

run_dir = create_run_dir(load_recipe({recipe!r}), "local")
write_checkpoint(run_dir / "checkpoints", "step_00000007", step=7)
r = CliRunner().invoke(app, ["status", str(run_dir), "--json"])
print("EXIT", r.exit_code, "torch" in sys.modules, "step_00000007" in r.output)
print(r.output)
"""


def test_status_of_a_local_run_does_not_import_torch(tmp_path):
    (tmp_path / ".v4launch").mkdir()
    code = CHECK.format(tests=str(Path(__file__).parent), recipe=str(REPO / "recipes" / "tiny_cpu.yaml"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "EXIT 0 False True" in out.stdout, out.stdout + out.stderr


def test_listing_names_only_complete_checkpoints(tmp_path):
    from v4launch.checkpoints.listing import latest_checkpoint, list_checkpoints

    assert latest_checkpoint(tmp_path / "missing") is None
    write_checkpoint(tmp_path, "step_00000003", step=3)
    write_checkpoint(tmp_path, "step_00000012", step=12)
    write_checkpoint(tmp_path, "step_00000020", metadata=False, step=20)  # DCP never finished
    write_checkpoint(tmp_path, "step_00000030", complete=False, step=30)  # manifest not marked complete
    write_checkpoint(tmp_path, ".tmp-step_00000040", step=40)  # never renamed into place
    (tmp_path / "step_00000050").mkdir()
    (tmp_path / "step_00000050" / ".metadata").write_bytes(b"")
    (tmp_path / "step_00000050" / "manifest.json").write_text("{not json")  # unreadable: skipped, no raise
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000012"]
    assert latest_checkpoint(tmp_path).name == "step_00000012"
