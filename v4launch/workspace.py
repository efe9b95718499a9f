"""The current workspace: where runs live and which recipe / run a command defaults to.

A workspace is the nearest directory, from the current one upwards, holding a
``.v4launch/`` folder; if there is none, the current directory becomes one on the
first command that records state. ``.v4launch/state.json`` remembers the recipe last
validated or run, with the overrides it was given, so ``v4launch validate flash_4n
cluster.nodes=8`` then ``v4launch submit --dry-run`` submits that same recipe, and
``v4launch resume --phase sparse`` works without naming the run; the CLI always says
which one it picked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UsageError

STATE_DIR = ".v4launch"
STATE_FILE = "state.json"
RUNS_DIR = "runs"
CEILING_ENV = "V4LAUNCH_CEILING_DIRECTORIES"


@dataclass(frozen=True)
class Workspace:
    """A workspace root and its remembered state."""

    root: Path

    @classmethod
    def current(cls, start: Path | None = None) -> "Workspace":
        """The workspace containing ``start`` (default: the working directory): the nearest folder, ``start`` or
        a parent, holding ``.v4launch/``, else ``start`` itself. The walk stops below any folder named in
        ``$V4LAUNCH_CEILING_DIRECTORIES`` (os.pathsep-separated, as git's GIT_CEILING_DIRECTORIES): a
        ``.v4launch/`` in a ceiling or above it is not this workspace's (the tests set it to their temporary
        root, so a workspace someone made in /tmp cannot leak into them)."""
        here = (start or Path.cwd()).resolve()
        ceilings = {Path(p).resolve() for p in os.environ.get(CEILING_ENV, "").split(os.pathsep) if p}
        for folder in (here, *here.parents):
            if folder in ceilings:
                break
            if (folder / STATE_DIR).is_dir():
                return cls(folder)
        return cls(here)

    @property
    def state_path(self) -> Path:
        return self.root / STATE_DIR / STATE_FILE

    def state(self) -> dict:
        """The remembered state (empty if none or unreadable)."""
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def remember(self, **values: Any) -> None:
        """Record values (e.g. ``recipe=...``) atomically in state.json."""
        state = self.state()
        state.update(values)
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
        os.replace(tmp, self.state_path)

    def remember_recipe(self, recipe: str, overrides: Sequence[str] = (), passed: bool | None = None) -> None:
        """Record ``recipe`` and the dotlist ``overrides`` it was last validated or run with (``passed``: whether
        that validation passed the contract; None when not validated). Other overrides of any recipe are forgotten."""
        self.remember(recipe=recipe, overrides={"recipe": recipe, "values": list(overrides), "passed": passed})

    def default_overrides(self) -> tuple[list[str], bool | None]:
        """(the overrides recorded with the workspace's recipe, whether they passed ``validate``); ([], None) when
        none were recorded with it (an older state file, or the recipe was recorded without overrides)."""
        state = self.state()
        kept = state.get("overrides")
        if not isinstance(kept, dict) or kept.get("recipe") != state.get("recipe"):
            return [], None
        values = kept.get("values")
        good = isinstance(values, list) and all(isinstance(v, str) for v in values)
        return (list(values), kept.get("passed")) if good else ([], None)

    def default_recipe(self) -> Path:
        """The recipe last validated or run here.

        Raises:
            UsageError: when no recipe was ever recorded or the file is gone.
        """
        recorded = self.state().get("recipe")
        if not recorded:
            raise UsageError(
                f"no recipe given and none recorded in workspace {self.root}",
                hint="name one, e.g. `v4launch validate flash_4n` (a shipped recipe by name) or a YAML path; later "
                     "commands then default to it",
            )
        path = Path(recorded)
        if not path.is_file():
            raise UsageError(
                f"the workspace's recipe {path} no longer exists",
                hint="name a recipe explicitly",
            )
        return path

    def runs_root(self, output_root: str = RUNS_DIR) -> Path:
        """Directory holding run directories (relative output roots resolve against the workspace)."""
        p = Path(output_root)
        return p if p.is_absolute() else self.root / p

    def newest_run(self, output_root: str = RUNS_DIR) -> Path:
        """The most recently created run directory (one holding ``run.json``).

        Raises:
            UsageError: when the workspace holds no run.
        """
        root = self.runs_root(output_root)
        runs = [p for p in root.glob("*/run.json")] if root.is_dir() else []
        if not runs:
            raise UsageError(
                f"no run given and no run found under {root}",
                hint="start one with `v4launch run RECIPE` or `v4launch submit RECIPE --nodes N`",
            )
        return max(runs, key=lambda p: (p.stat().st_mtime, str(p))).parent
