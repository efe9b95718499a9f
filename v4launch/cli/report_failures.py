"""`v4launch validate --quiet`: only the failing and warning findings, each printed once with its stages.

A finding that repeats across stages (the same rule, field, value and fix: a recipe-wide setting
read by every stage) is one row naming the stages it holds in, where the full report prints it under
each stage; where the stages' own figures in the message differ, the row quotes the first stage's. Passing and not-applicable rows, the per-stage figures and the memory and time
tables are left out; the verdict line and the exit code are the full report's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from .fix_command import pasteable
from .report_format import cell, header

if TYPE_CHECKING:
    from ..validators import Report, Violation
    from .combined_fix import CombinedFix

STYLE = {"fail": "bold red", "warn": "yellow"}


def grouped(report: Report) -> list[tuple[Violation, list[str], bool]]:
    """Each distinct finding (errors first, then warnings, in report order) with the stages it occurs in
    (``"recipe-wide"`` for a recipe-scoped rule) and whether their messages differ (stage figures)."""
    groups: dict[tuple, tuple[Violation, list[str], set[str]]] = {}
    for v in [*report.violations, *report.warnings]:
        key = (v.rule_id, v.severity, v.field, repr(v.value), v.fix)
        first, stages, messages = groups.setdefault(key, (v, [], set()))
        stages.append(v.stage or "recipe-wide")
        messages.add(v.message)
    return [(v, stages, len(messages) > 1) for v, stages, messages in groups.values()]


def _stages(names: list[str], total: int) -> str:
    if names == ["recipe-wide"]:
        return "recipe-wide"
    return f"all {total} stages" if len(names) == total and total > 1 else ", ".join(names)


def render_failures(report: Report, recipe: Any, con: Any, command: tuple[str, list[str]],
                    combined: CombinedFix | None = None) -> None:
    """Print the header line, one row per distinct failing or warning finding with its fix, and the verdict.

    Args:
        report: the validation report. recipe: the validated ``Recipe`` (for the header). con: the rich console.
        command: the recipe path and overrides as given (each fix is printed as a command to paste).
        combined: the merged fix of several failing rules, printed after the rules' own fixes (None: none).
    """
    header(report, recipe, con)
    rows = grouped(report)
    total = len(report.stages)
    if rows:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for name in ("status", "rule", "stages", "field = value", "set at", "note"):
            table.add_column(name, overflow="fold")
        for v, names, differ in rows:
            status = "fail" if v.severity == "error" else "warn"
            note = v.message + (f" (in {names[0]}; each stage's own figures: without --quiet)" if differ else "")
            table.add_row(Text(status, style=STYLE[status]), v.rule_id, _stages(names, total),
                          f"{v.field} = {cell(v.value)}", v.source, Text(note, style=STYLE[status]))
        con.print(table)
    printed: dict[str, str] = {}
    for v, _, _ in rows:
        head = Text("  → ", style="cyan") + Text(f"{v.rule_id}: ", style="bold")
        text = f"fix: the same as {printed[v.fix]}'s (above)" if v.fix in printed else \
            f"fix: {pasteable(v.fix, *command)}"
        printed.setdefault(v.fix, v.rule_id)
        con.print(head + Text(text, style="cyan"), soft_wrap=True)  # one line: a fix is pasted whole
    if combined is not None:
        con.print(combined.line(), soft_wrap=True)
    hidden = sum(1 for r in report.all_results if r.status in ("pass", "n/a"))
    n_err, n_warn = len(report.violations), len(report.warnings)
    verdict = "[bold green]OK[/bold green]" if report.ok else "[bold red]FAIL[/bold red]"
    con.print(f"\n{verdict}: {n_err} violation{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)} "
              f"(exit {0 if report.ok else 1}); {hidden} passing or n/a rows not shown (--quiet); "
              "`v4launch explain RULE` describes a rule")
