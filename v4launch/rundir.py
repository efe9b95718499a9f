"""The run directory contract: one folder per run, the same for local and Slurm runs.

Layout (documented in docs/training.md)::

    <workspace>/<run.output_root>/<recipe.name>-<YYYYmmdd-HHMMSS>/
        run.json        identity: name, created, recipe name + hash, launcher, extra (git sha, ...)
        recipe.yaml     the frozen, fully resolved recipe the job reads (re-frozen by `resume --recipe`)
        checkpoints/    step_<N>/ checkpoints with their manifest (v4launch.checkpoints)
        metrics.jsonl   one JSON object per logged step (and one per evaluation)
        tb/             TensorBoard event files (when logging.tensorboard)
        logs/           rank<R>.log plain-text logs of each rank; launcher logs
        resume.json     pending resume request written by `v4launch resume` (consumed by the job)
        launch.json     what the launcher last did (pid / job id, state, result)

The job (v4launch.training.job.train) only ever reads ``recipe.yaml`` and
``resume.json`` from here, so a run directory is self-contained: it can be moved,
resumed on another launcher, or inspected without the original recipe file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from .errors import UsageError
from .workspace import Workspace

RUN_JSON = "run.json"
RECIPE_YAML = "recipe.yaml"
RESUME_JSON = "resume.json"
LAUNCH_JSON = "launch.json"
METRICS = "metrics.jsonl"

LauncherName = Literal["local", "slurm"]


@dataclass(frozen=True)
class RunPaths:
    """Well-known paths inside one run directory."""

    root: Path

    @property
    def run_json(self) -> Path:
        return self.root / RUN_JSON

    @property
    def recipe(self) -> Path:
        return self.root / RECIPE_YAML

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def resume(self) -> Path:
        return self.root / RESUME_JSON

    @property
    def launch(self) -> Path:
        return self.root / LAUNCH_JSON


def recipe_hash(recipe: Any) -> str:
    """sha256 (hex) of the resolved recipe's canonical JSON (sorted keys, no spaces).

    The same identity checkpoint manifests carry (``v4launch.checkpoints.base.recipe_hash``), computed
    here without importing torch.
    """
    payload = json.dumps(recipe.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def git_sha(cwd: Path | None = None) -> str | None:
    """The checkout's HEAD commit (with ``-dirty`` when the tree has changes), or None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` via a temp file + rename (readers never see half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def create_run_dir(loaded: Any, launcher: LauncherName, extra: dict[str, Any] | None = None,
                   *, workspace: Workspace | None = None, now: datetime | None = None) -> Path:
    """Create a fresh run directory for ``loaded`` (a LoadedRecipe) and freeze its recipe.

    Args:
        loaded: the loaded recipe (``.recipe``, ``.to_yaml()``, ``.path``).
        launcher: ``"local"`` or ``"slurm"``: recorded in run.json; ``launcher_for`` dispatches on it.
        extra: free JSON-able facts stored under run.json["extra"] (e.g. ``{"git_sha": ...}``).
        workspace: workspace root (default: the current one); ``run.output_root`` resolves against it.
        now: creation time (default: now, local time in the name, UTC ISO in run.json).

    Returns:
        The new directory ``<workspace>/<run.output_root>/<name>-<YYYYmmdd-HHMMSS>`` (a ``-2``, ``-3``
        suffix is added when two runs start within the same second).
    """
    if launcher not in ("local", "slurm"):
        raise UsageError(f"unknown launcher {launcher!r}", hint="use 'local' or 'slurm'")
    recipe = loaded.recipe
    ws = workspace or Workspace.current()
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    root = ws.runs_root(recipe.run.output_root)
    root.mkdir(parents=True, exist_ok=True)
    run_dir, n = root / f"{recipe.name}-{stamp}", 1
    while True:
        try:
            run_dir.mkdir()
            break
        except FileExistsError:
            n += 1
            run_dir = root / f"{recipe.name}-{stamp}-{n}"
    paths = RunPaths(run_dir)
    for sub in (paths.checkpoints, paths.tb, paths.logs):
        sub.mkdir()
    paths.metrics.touch()
    yaml_text = loaded.to_yaml()
    paths.recipe.write_text(yaml_text)
    write_json_atomic(paths.run_json, {
        "name": run_dir.name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": recipe.name,
        "recipe_hash": recipe_hash(recipe),
        "recipe_source": str(getattr(loaded, "path", "") or ""),
        "launcher": launcher,
        "extra": dict(extra or {}),
    })
    return run_dir


def refreeze_recipe(run_dir: Path, loaded: Any) -> str:
    """Replace the run's frozen recipe with ``loaded`` (``resume --recipe``); returns the new hash.

    The previous recipe is kept as ``recipe.<old-hash>.yaml`` and the change is appended to
    run.json["recipe_history"], so what each segment of the run trained with stays on disk.
    """
    paths = RunPaths(Path(run_dir))
    meta = read_run_json(run_dir)
    old_text = paths.recipe.read_text()
    (paths.root / f"recipe.{str(meta.get('recipe_hash', 'previous'))[:12]}.yaml").write_text(old_text)
    new_hash = recipe_hash(loaded.recipe)
    paths.recipe.write_text(loaded.to_yaml())
    meta.setdefault("recipe_history", []).append(
        {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "from": meta.get("recipe_hash"), "to": new_hash})
    meta["recipe_hash"] = new_hash
    write_json_atomic(paths.run_json, meta)
    return new_hash


def read_run_json(run_dir: Path) -> dict[str, Any]:
    """run.json of ``run_dir`` as a dict.

    Raises:
        UsageError: when ``run_dir`` is not a run directory (no readable run.json).
    """
    path = RunPaths(Path(run_dir)).run_json
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        if not Path(run_dir).exists():
            why = "no such directory"
        elif not path.exists():
            why = f"it has no {path.name}"
        else:
            why = f"cannot read {path.name}: {getattr(exc, 'strerror', None) or exc}"
        runs = sorted(p.name for p in Path(run_dir).parent.glob("*") if (p / path.name).is_file())[-3:]
        raise UsageError(f"{run_dir} is not a run directory ({why})",
                         hint="pass a directory created by `v4launch run` or `v4launch submit`, or its name under "
                              "the workspace's runs/"
                              + (f"; the newest beside it: {', '.join(runs)}" if runs else
                                 ", e.g. runs/tiny_cpu-20260101-120000 or tiny_cpu-20260101-120000")) from None


@dataclass(frozen=True)
class RunInfo:
    """A loaded run directory: its paths, run.json and frozen recipe."""

    paths: RunPaths
    meta: dict[str, Any]
    loaded: Any  # LoadedRecipe of recipe.yaml

    @property
    def recipe(self) -> Any:
        return self.loaded.recipe

    @property
    def launcher(self) -> str:
        return self.meta.get("launcher", "local")


def load_run(run_dir: Path) -> RunInfo:
    """Read a run directory: run.json and the frozen recipe.yaml (validated against the schema).

    Raises:
        UsageError: not a run directory, or its recipe.yaml no longer loads.
    """
    from .training.recipe_io import load_recipe

    run_dir = Path(run_dir).resolve()
    meta = read_run_json(run_dir)
    paths = RunPaths(run_dir)
    if not paths.recipe.is_file():
        raise UsageError(f"run {run_dir} has no {RECIPE_YAML}", hint="the run directory is incomplete; start a new run")
    return RunInfo(paths=paths, meta=meta, loaded=load_recipe(paths.recipe, []))


def read_resume_request(run_dir: Path) -> dict[str, Any] | None:
    """The pending resume request (resume.json) or None."""
    path = RunPaths(Path(run_dir)).resume
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}", hint="delete it and run `v4launch resume` again") from None


def write_resume_request(run_dir: Path, request: dict[str, Any]) -> Path:
    """Write resume.json (atomically); the next ``train()`` on this run honours it once."""
    path = RunPaths(Path(run_dir)).resume
    write_json_atomic(path, request)
    return path


def consume_resume_request(run_dir: Path) -> None:
    """Mark the pending resume request as honoured (renamed to resume.done.json)."""
    path = RunPaths(Path(run_dir)).resume
    if path.exists():
        os.replace(path, path.with_name("resume.done.json"))
