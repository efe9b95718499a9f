"""Recipe loading for the job and the run/resume commands.

Uses ``v4launch.recipe_loading.load_recipe`` (the project's loader: composition,
interpolation, provenance) when it is importable; otherwise a minimal local loader
with the same result shape (omegaconf load + dotlist overrides + ``Recipe.model_validate``).
Validation likewise uses ``v4launch.validators.validate_recipe`` when available.
"""

from __future__ import annotations

import shlex

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import ContractViolation, RecipeError


@dataclass(frozen=True)
class _LoadedRecipe:
    """Fallback LoadedRecipe: ``.recipe`` (Recipe), ``.resolved`` (dict), ``.path``, ``.to_yaml()``."""

    recipe: Any
    resolved: dict
    path: Path | None

    def to_yaml(self) -> str:
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.create(self.resolved))


def _fallback_load(path: Path, overrides: Sequence[str]) -> _LoadedRecipe:
    from omegaconf import OmegaConf
    from pydantic import ValidationError

    from ..validators.schema import Recipe

    try:
        cfg = OmegaConf.load(path)
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # omegaconf / yaml errors of many kinds
        raise RecipeError(f"cannot read recipe {path}: {exc}", hint="check the YAML syntax and the overrides") from None
    try:
        recipe = Recipe.model_validate(resolved)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise RecipeError(f"recipe {path}: {loc}: {first['msg']} ({exc.error_count()} error(s))",
                          hint="run `v4launch validate` on it for the full report") from None
    return _LoadedRecipe(recipe=recipe, resolved=resolved, path=Path(path))


def load_recipe(path: Path | str, overrides: Sequence[str] = ()) -> Any:
    """Load ``path`` with dotlist ``overrides`` into a LoadedRecipe.

    Raises:
        RecipeError: unreadable file or schema mismatch (exit 2).
    """
    path = Path(path)
    try:
        from ..recipe_loading import load_recipe as project_load  # type: ignore[attr-defined]
    except ImportError:
        if not path.is_file():
            raise RecipeError(f"recipe {path} does not exist",
                              hint="name an existing YAML file, e.g. recipes/tiny_cpu.yaml") from None
        return _fallback_load(path, overrides)
    return project_load(path, list(overrides))  # a path, or a shipped recipe's name (as `validate` takes)


def _stage_label(names: list[str]) -> str:
    named = [n for n in names if n]
    if not named:
        return ""
    return f" [stage {named[0]}]" if len(named) == 1 else f" [stages {', '.join(named)}]"


def check_recipe(loaded: Any) -> list[str]:
    """Validate the contract, then plan the curriculum as the job will; return warning lines.

    The one check ``run``, ``submit`` and ``resume`` make before anything is created or queued.

    Raises:
        ContractViolation: when the report has violations (the message lists every rule id), or
            when the job's planner refuses a recipe the contract allows (``plan.plan_curriculum``).
    """
    try:
        from ..validators import validate_recipe  # type: ignore[attr-defined]
    except ImportError:
        return []
    report = validate_recipe(loaded)
    if not report.ok:
        stages: dict[tuple, list[str]] = {}  # the same violation in several stages: one line naming them all
        for v in report.violations:
            key = (v.rule_id, f" {v.field}={v.value!r}: {v.message} (set at {v.source}; fix: ", v.fix)
            stages.setdefault(key, []).append(str(v.stage) if v.stage else "")
        lines, fixes = [], set()  # a fix several lines share (V4-MEMORY's whole-recipe one) is written once
        for (rule_id, text, fix), names in stages.items():
            lines.append(f"{rule_id}{_stage_label(names)}{text}{'as above' if fix in fixes else fix})")
            fixes.add(fix)
        ids = ", ".join(sorted(report.failed_rule_ids()))
        from ..recipe_loading import display_path

        again = shlex.join(["v4launch", "validate", display_path(loaded.path), *getattr(loaded, "overrides", ())])
        raise ContractViolation(
            f"[{ids}] recipe {loaded.recipe.name} breaks the V4 contract ({len(lines)} violation(s)):\n  " + "\n  ".join(lines),
            hint=f"`{again}` gives the full report (the same recipe and overrides); fix the fields, then run again")
    from .plan import plan_curriculum

    plan_curriculum(loaded.recipe, loaded.recipe.cluster.world_size)  # the job refuses what it cannot run
    repeated = getattr(loaded, "repeated_overrides", list)()  # overrides given twice: the last applies, said
    return [f"{w.rule_id}: {w.message}" for w in report.warnings] + list(repeated)
