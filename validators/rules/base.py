"""Rule registry and the per-stage context rules read.

A rule is one function registered with ``@rule(...)``. Its docstring's first line is the
rule's statement and a ``Source:`` line names where it comes from; both are shown by
``v4launch explain``. A rule reads a ``Context`` (the typed recipe plus one curriculum
stage) and returns findings, never raises on user input:

* ``None`` or ``[]`` — pass; ``ctx.ok(field, value)`` — pass, showing the value checked;
* ``ctx.na("why")`` — the rule does not apply to this stage;
* ``ctx.finding(field, value, message)`` (or a list of them) — a violation, reported with
  the rule's severity (error → fail, warning → warn).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Literal

from ..layout import Layout, LayoutSyntaxError, parse_layout, structure_problems
from ..schema.attention import KernelBackend
from ..schema.curriculum import Stage
from ..schema.recipe import Recipe

Severity = Literal["error", "warning"]
Scope = Literal["recipe", "stage"]


@dataclass(frozen=True)
class Finding:
    """One violation: the field it is about (dotted path), its value, what is wrong, and an optional specific fix."""

    field: str
    value: Any
    message: str
    fix: str | None = None


@dataclass(frozen=True)
class NotApplicable:
    """The rule does not apply here (e.g. a CP rule at CP=1)."""

    reason: str


@dataclass(frozen=True)
class Checked:
    """A pass, with the field and value that were checked."""

    field: str
    value: Any
    note: str = ""


Outcome = Finding | NotApplicable | Checked | list[Finding] | None


@dataclass(frozen=True)
class Rule:
    """A registered contract rule (see the module docstring)."""

    id: str
    statement: str
    source: str
    fields: tuple[str, ...]
    fix: str
    severity: Severity
    scope: Scope
    check: Callable[["Context"], Outcome] = field(repr=False, compare=False)


RULES: dict[str, Rule] = {}
"""Every registered rule by id, in registration order."""


def _docstring_parts(func: Callable) -> tuple[str, str]:
    doc = inspect.getdoc(func) or ""
    lines = doc.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("Source:")), None)
    if not lines or start is None:
        raise TypeError(f"rule {func.__name__}: docstring needs a statement line and a 'Source:' line")
    source = [lines[start].split(":", 1)[1].strip()]
    for ln in lines[start + 1:]:  # the paragraph the Source: line opens (its continuation lines)
        if not ln.strip():
            break
        source.append(ln.strip())
    return lines[0].strip(), " ".join(source)


def rule(rule_id: str, *, fields: tuple[str, ...], fix: str, severity: Severity = "error", scope: Scope = "stage"):
    """Register ``func`` as contract rule ``rule_id`` (statement and source come from its docstring)."""

    def register(func: Callable[["Context"], Outcome]) -> Callable[["Context"], Outcome]:
        if rule_id in RULES:
            raise TypeError(f"duplicate rule id {rule_id}")
        statement, source = _docstring_parts(func)
        RULES[rule_id] = Rule(rule_id, statement, source, fields, fix, severity, scope, func)
        return func

    return register


def micro_batches(n: int) -> str:
    """'micro-batch' or 'micro-batches' for a count of ``n``."""
    return "micro-batch" if n == 1 else "micro-batches"


class Context:
    """What a rule reads: the recipe and, for stage-scoped rules, one stage and its neighbours."""

    def __init__(self, recipe: Recipe, index: int | None = None):
        self.recipe = recipe
        self.model = recipe.model
        self.parallel = recipe.parallel
        self.index = index
        stages = recipe.curriculum.stages
        self.stage: Stage | None = stages[index] if index is not None else None
        self.prev: Stage | None = stages[index - 1] if index else None

    # -- outcomes -------------------------------------------------------------------------
    @staticmethod
    def finding(field: str, value: Any, message: str, fix: str | None = None) -> Finding:
        return Finding(field, value, message, fix)

    @staticmethod
    def na(reason: str) -> NotApplicable:
        return NotApplicable(reason)

    @staticmethod
    def ok(field: str, value: Any, note: str = "") -> Checked:
        return Checked(field, value, note)

    # -- stage-effective values and the field that set them ---------------------------------
    def stage_path(self, attr: str) -> str:
        """Dotted path of ``attr`` of the current stage, e.g. ``curriculum.stages.3.cp``."""
        return f"curriculum.stages.{self.index}.{attr}"

    @property
    def seq_len(self) -> int:
        return self.stage.seq_len if self.stage else 0

    @property
    def cp(self) -> int:
        return self.recipe.stage_cp(self.stage) if self.stage else self.parallel.cp

    @property
    def cp_field(self) -> str:
        return self.stage_path("cp") if self.stage and self.stage.cp is not None else "parallel.cp"

    @property
    def dp(self) -> int | None:
        return self.recipe.stage_dp(self.stage) if self.stage else None

    @property
    def backend(self) -> KernelBackend:
        own = self.stage.kernel_backend if self.stage else None
        return own or self.recipe.attention.kernel_backend

    @property
    def backend_field(self) -> str:
        return self.stage_path("kernel_backend") if self.stage and self.stage.kernel_backend else "attention.kernel_backend"

    @property
    def global_batch_field(self) -> str:
        return self.stage_path("global_batch_size") if self.stage and self.stage.global_batch_size else "parallel.global_batch_size"

    @property
    def sm(self) -> int | None:
        return self.recipe.cluster.sm

    @property
    def all_ratios(self) -> tuple[int, ...]:
        return tuple(self.model.compress_ratios)

    # -- pipeline layout (parsed once per context) ----------------------------------------
    @cached_property
    def layout(self) -> Layout | None:
        """The parsed ``parallel.pp_layout``; None when unset, unparseable or unread (at pp·vpp = 1 the job runs
        the whole model as one stage: V4-PP-LAYOUT refuses the layout, and no other rule judges it)."""
        text = self.parallel.pp_layout
        if text is None or self.parallel.pp * self.parallel.vpp == 1:
            return None
        try:
            return parse_layout(text)
        except LayoutSyntaxError:
            return None

    @cached_property
    def layout_problems(self) -> list[str]:
        if self.layout is None:
            return []
        p, m = self.parallel, self.model
        return structure_problems(self.layout, p.pp, p.vpp, m.n_layers, m.mtp.depth)
