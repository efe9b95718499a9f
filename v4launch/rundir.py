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
    """The run's recipe identity: ``v4launch.checkpoints.base.recipe_hash`` (sha256 of the recipe's
    canonical JSON, computed fields left out), the same hash the checkpoint manifests carry."""
    from .checkpoints.base import recipe_hash as canonical  # torch-free: listing a run never loads torch

    return canonical(recipe)


@dataclass(frozen=True)
class CodeRevision:
    """The source revision a run was started from (local or Slurm alike).

    Attributes:
        repo: the git checkout holding the v4launch sources (None outside git).
        sha: its HEAD commit.
        dirty: True when tracked files differ from HEAD or untracked files exist.
        diff: ``git diff HEAD --binary`` when dirty (saved as ``code.diff`` in the run).
        untracked: untracked files (relative to ``repo``).
    """

    repo: str | None
    sha: str | None
    dirty: bool
    diff: str = ""
    untracked: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """What run.json["extra"]["code"] records (the diff itself goes to code.diff)."""
        return {"repo": self.repo, "git_sha": self.sha, "dirty": self.dirty, "untracked": list(self.untracked)}


def _git(repo: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def code_revision(repo: Path | None = None) -> CodeRevision:
    """git sha, dirtiness, diff and untracked files of the checkout holding the v4launch sources.

    Args:
        repo: the checkout (default: the one this package lives in, wherever the command runs from).
    """
    if repo is None:
        repo = Path(__file__).resolve().parent.parent
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top is None:
        return CodeRevision(repo=None, sha=None, dirty=False)
    root = Path(top.strip())
    sha = (_git(root, "rev-parse", "HEAD") or "").strip() or None
    status = _git(root, "status", "--porcelain", "--untracked-files=all") or ""
    untracked = tuple(line[3:] for line in status.splitlines() if line.startswith("??"))
    dirty = bool(status.strip())
    diff = (_git(root, "diff", "HEAD", "--binary") or "") if dirty else ""
    return CodeRevision(repo=str(root), sha=sha, dirty=dirty, diff=diff, untracked=untracked)


CODE_DIFF = "code.diff"


def record_code(run_dir: Path, rev: CodeRevision) -> dict[str, Any]:
    """Write ``code.diff`` for a dirty tree; return the run.json extra entries (``code``, ``git_sha``)."""
    if rev.dirty:
        (Path(run_dir) / CODE_DIFF).write_text(rev.diff + "".join(f"# untracked: {p}\n" for p in rev.untracked))
    return {"code": rev.to_json(), "git_sha": rev.sha}


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
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK):
            raise PermissionError(f"{root} is not writable")
    except OSError as exc:
        raise UsageError(f"run.output_root={recipe.run.output_root!r}: cannot create run directories under {root} "
                         f"({exc.strerror or exc})",
                         hint="set run.output_root to a writable folder (relative paths resolve against the "
                              "workspace), e.g. run.output_root=runs") from None
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


def refreeze_recipe(run_dir: Path, loaded: Any, extra: dict[str, Any] | None = None) -> str:
    """Replace the run's frozen recipe with ``loaded`` (an accepted ``resume`` with a new recipe or
    overrides); returns the new hash.

    The previous recipe is kept as ``recipe.<old-hash[:12]>.yaml`` (the hash its checkpoints' manifests
    carry) and the change is appended to run.json["recipe_history"], so what each segment of the run
    trained with stays on disk. ``extra`` entries replace run.json["extra"]'s (None values remove one),
    e.g. the data prefix of a resume that changed the ``data:`` section.
    """
    paths = RunPaths(Path(run_dir))
    meta = read_run_json(run_dir)
    old_text = paths.recipe.read_text()
    old_hash = recipe_hash(load_run(run_dir).recipe)
    (paths.root / f"recipe.{old_hash[:12]}.yaml").write_text(old_text)
    new_hash = recipe_hash(loaded.recipe)
    paths.recipe.write_text(loaded.to_yaml())
    meta.setdefault("recipe_history", []).append(
        {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "from": old_hash, "to": new_hash})
    meta["recipe_hash"] = new_hash
    _merge_extra(meta, extra or {})
    write_json_atomic(paths.run_json, meta)
    return new_hash


def _merge_extra(meta: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if value is None:
            meta.setdefault("extra", {}).pop(key, None)
        else:
            meta.setdefault("extra", {})[key] = value


def update_run_extra(run_dir: Path, values: dict[str, Any]) -> None:
    """Merge ``values`` into run.json["extra"] (atomically); a None value removes its key."""
    meta = read_run_json(run_dir)
    _merge_extra(meta, values)
    write_json_atomic(RunPaths(Path(run_dir)).run_json, meta)


def recipe_on_record(run_dir: Path, digest: str) -> dict[str, Any] | None:
    """The recipe (``recipe_fields`` dict) of ``run_dir`` whose hash is ``digest``: the frozen
    recipe.yaml or a ``recipe.*.yaml`` kept by a re-freeze (any file name: runs of older versions
    named them by another hash); None when no file of the run has that hash."""
    from .checkpoints.base import recipe_fields
    from .training.recipe_io import load_recipe

    root = Path(run_dir)
    for path in [root / RECIPE_YAML, *sorted(root.glob("recipe.*.yaml"))]:
        try:
            fields = recipe_fields(load_recipe(path, []).recipe)
        except Exception:  # noqa: BLE001 - an unreadable old copy is simply not the one
            continue
        if recipe_hash(fields) == digest:
            return fields
    return None


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
