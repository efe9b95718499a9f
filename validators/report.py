"""Run every contract rule over a recipe (recipe-wide rules once, stage rules per stage) into a ``Report``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .figures import stage_figures
from .rules import RULES, Checked, Context, Finding, NotApplicable, Rule
from .schema.recipe import Recipe
from .time_plan import time_plan

Status = str  # "pass" | "fail" | "warn" | "n/a"


@dataclass(frozen=True)
class Violation:
    """A failed (error) or warned (warning) rule: what, where it was set, and the fix."""

    rule_id: str
    severity: str
    stage: str | None
    field: str
    value: Any
    source: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RuleResult:
    """One rule's outcome for one stage (or the whole recipe)."""

    rule_id: str
    status: Status
    field: str | None = None
    value: Any = None
    source: str | None = None
    note: str = ""
    violations: tuple[Violation, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["violations"] = [v.to_dict() for v in self.violations]
        return d


@dataclass(frozen=True)
class StageResult:
    """Results and derived figures of one curriculum stage."""

    index: int
    name: str
    phase: str
    results: tuple[RuleResult, ...]
    derived: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "phase": self.phase,
                "results": [r.to_dict() for r in self.results], "derived": self.derived}


@dataclass(frozen=True)
class Report:
    """The contract report. ``ok`` is True when no error-severity rule failed (warnings allowed)."""

    recipe: str
    path: str | None
    recipe_results: tuple[RuleResult, ...]
    stages: tuple[StageResult, ...]
    all_results: tuple[RuleResult, ...] = field(repr=False, default=())
    time: dict[str, Any] | None = None
    """The time plan (``time_plan.TimePlan.to_dict``: per stage, totals, assumptions); None without an estimate."""

    @property
    def violations(self) -> list[Violation]:
        """Every error-severity finding, in report order."""
        return [v for r in self.all_results for v in r.violations if v.severity == "error"]

    @property
    def warnings(self) -> list[Violation]:
        """Every warning-severity finding, in report order."""
        return [v for r in self.all_results for v in r.violations if v.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.violations

    def failed_rule_ids(self) -> set[str]:
        """Ids of rules that failed anywhere."""
        return {v.rule_id for v in self.violations}

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "path": self.path, "ok": self.ok,
            "rules": len(RULES),
            "violations": [v.to_dict() for v in self.violations],
            "warnings": [v.to_dict() for v in self.warnings],
            "recipe_results": [r.to_dict() for r in self.recipe_results],
            "stages": [s.to_dict() for s in self.stages],
            "time_plan": self.time,
        }


def _set_at(rule: Rule, field: str, source_of: Callable[[str], str]) -> str:
    """Where the finding's field was set, plus any override of another field the rule reads: a
    finding reported on ``cluster.gpus_per_node`` but caused by ``--nodes 3`` names that override."""
    own = source_of(field)
    others = [source_of(f) for f in rule.fields if "*" not in f and f != field]
    extra = sorted({src for src in others if src.startswith("override") and src != own})
    return own if not extra else f"{own}; {'; '.join(extra)}"


def _run(rule: Rule, ctx: Context, source_of: Callable[[str], str]) -> RuleResult:
    """Evaluate one rule; a crash inside a rule is reported as a failure, never raised."""
    stage = ctx.stage.name if ctx.stage else None
    try:
        out = rule.check(ctx)
    except Exception as exc:  # a bug in a rule must not hide the rest of the report
        out = Finding("-", None, f"internal error while checking ({type(exc).__name__}: {exc}); please report it")
    if isinstance(out, NotApplicable):
        return RuleResult(rule.id, "n/a", note=out.reason)
    if isinstance(out, Checked):
        return RuleResult(rule.id, "pass", out.field, out.value, source_of(out.field), out.note)
    findings = [out] if isinstance(out, Finding) else list(out or [])
    if not findings:
        return RuleResult(rule.id, "pass")
    violations = tuple(
        Violation(rule.id, rule.severity, stage, f.field, f.value, _set_at(rule, f.field, source_of), f.message,
                  f.fix or rule.fix)
        for f in findings
    )
    first = violations[0]
    status = "fail" if rule.severity == "error" else "warn"
    return RuleResult(rule.id, status, first.field, first.value, first.source, first.message, violations)


def _figures(recipe: Recipe, stage: Any) -> dict[str, Any]:
    try:
        return stage_figures(recipe, stage)
    except Exception as exc:  # figures are informative; a recipe odd enough to break them is reported by the rules
        return {"error": f"{type(exc).__name__}: {exc}"}


def _time(recipe: Recipe) -> dict[str, Any] | None:
    """The curriculum's time plan as a dict, None when there is none (a CPU target, DP undefined)."""
    try:
        plan = time_plan(recipe)
    except Exception:  # informative, as the figures; a recipe odd enough to break it is reported by the rules
        return None
    return plan.to_dict() if plan else None


def validate_recipe(recipe: Any, source_of: Callable[[str], str] | None = None) -> Report:
    """Check ``recipe`` against every contract rule and return the report (never raises on violations).

    Args:
        recipe: a ``Recipe``, or a loaded recipe (any object with ``.recipe`` and ``.source_of``,
            e.g. ``v4launch.recipe_loading.LoadedRecipe``), whose sources then appear in the report.
        source_of: maps a dotted field to where it was set ("file:line", "override k=v",
            "default"); defaults to the loaded recipe's, else "-".
    """
    path = None
    if not isinstance(recipe, Recipe) and hasattr(recipe, "recipe"):
        source_of = source_of or getattr(recipe, "source_of", None)
        path = str(getattr(recipe, "path", "") or "") or None
        recipe = recipe.recipe
    where = source_of or (lambda _field: "-")
    recipe_ctx = Context(recipe)
    recipe_results = tuple(_run(r, recipe_ctx, where) for r in RULES.values() if r.scope == "recipe")
    plan = _time(recipe)
    stages = []
    for i, stage in enumerate(recipe.curriculum.stages):
        ctx = Context(recipe, i)
        results = tuple(_run(r, ctx, where) for r in RULES.values() if r.scope == "stage")
        figures = _figures(recipe, stage)
        figures["time"] = plan["stages"][i] if plan else None
        stages.append(StageResult(i, stage.name, stage.phase, results, figures))
    everything = recipe_results + tuple(r for s in stages for r in s.results)
    return Report(recipe.name, path, recipe_results, tuple(stages), everything, plan)
