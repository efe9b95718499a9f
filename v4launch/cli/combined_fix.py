"""`v4launch validate`'s combined fix: one line to paste when a recipe fails several rules.

Each failing rule prints its own fix (``fix_command.pasteable``), which fixes that rule and breaks no other, so
where two or more rules fail with fixes made of edits no one printed line passes. ``combine`` merges the fixes:
the first alternative of each rule's fix, pipeline-layout rules first and the memory rules last (their fix is
one set of edits for the whole curriculum, checked against every stage, so it has the last word on a key they
share), a later edit of a key replacing an earlier one. It validates the user's overrides plus the merged edits
in-process and, while rules still fail with fixes, merges those and validates again, for at most ``ROUNDS``
rounds; a passing merge is then pruned of the fixes it passes without (one more validation per merged rule,
the memory rules' last). The line is offered only when a merged candidate validates (exit 0); otherwise the
result names the rules still failing. ``validate`` calls it only for a failing report; with fewer than two such
rules it validates nothing. Pure Python like the rest of ``validate``: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rich.text import Text

from ..errors import RecipeError
from .fix_command import alternatives, command_line, kept_overrides

if TYPE_CHECKING:
    from ..validators import Report

ROUNDS = 3
"""Most merge rounds, each one in-process load + validate of a candidate: about 0.05 s for a Flash recipe, about
1 s where the candidate fails V4-MEMORY (which then searches for its own fix)."""

_LAST = ("V4-MEMORY", "V4-HOST-MEMORY")
"""Rules merged last: a memory fix is a whole shape (pp, ep, cp, storage) checked against every stage."""


@dataclass(frozen=True)
class CombinedFix:
    """The outcome of merging several rules' fixes.

    ``found``: a merged candidate validates with exit 0, and ``command`` is the line to paste. ``edits``: the
    merged fix overrides, in order (the user's overrides the edits set again are left out of ``command``).
    ``rules``: the rules whose fixes were merged, in merge order. ``validations``: candidates validated.
    ``still_failing``: the rules the last candidate fails (empty when found). ``note``: what the line gives, or
    why there is none.
    """

    found: bool
    command: str | None
    edits: tuple[str, ...]
    rules: tuple[str, ...]
    validations: int
    still_failing: tuple[str, ...]
    note: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> Text:
        """The report line: ``fix all: run `…` (passes: …)`` or ``fix all: no combined fix found: …``."""
        head = Text("  → ", style="cyan") + Text("fix all: ", style="bold")
        if self.found:
            return head + Text(f"run `{self.command}` (passes: {self.note})", style="cyan")
        return head + Text(f"no combined fix found: {self.note}; follow the rules' lines one at a time", style="yellow")


def _fixes(report: Report) -> list[tuple[str, list[str]]]:
    """(rule, edits of its fix's first alternative) of each failing finding with a pasteable fix, once per
    distinct fix, pipeline rules first and the memory rules last (report order otherwise)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for v in report.violations:
        options = alternatives(v.fix)
        if options:
            seen.setdefault((v.rule_id, v.fix), options[0])
    rank = {rule: 0 if rule.startswith("V4-PP-") else 2 if rule in _LAST else 1 for rule, _ in seen}
    return sorted(((rule, edits) for (rule, _), edits in seen.items()), key=lambda item: rank[item[0]])


def _merged(parts: list[tuple[str, list[str]]]) -> list[str]:
    """The edits of ``parts`` ((rule, edits), in merge order), a key set again replacing the earlier edit at the end."""
    merged: dict[str, str] = {}
    for _, edits in parts:
        for edit in edits:
            key = edit.split("=", 1)[0]
            merged.pop(key, None)
            merged[key] = edit
    return list(merged.values())


def _passes(report: Report, rules: list[str], dropped: list[str]) -> str:
    """What a passing candidate gives: the rules whose fixes it merges (and those that then pass without their
    own), the memory plan's peak, the warnings left."""
    plans = [(s.name, s.derived.get("memory")) for s in report.stages]
    text = f"{rules[0]}'s fix" if len(rules) == 1 else "the fixes of " + ", ".join(rules) + " merged"
    if dropped:
        one = len(dropped) == 1
        text += f"; {', '.join(dropped)} then pass{'es' * one} without {'its' if one else 'their'} own"
    if plans and all(m and m.get("fits") for _, m in plans):
        name, peak = max(((n, m["total_bytes"]) for n, m in plans), key=lambda item: item[1])
        text += f"; every stage fits, at most {peak / 2**30:.1f} GiB in stage {name}"
    n_warn = len(report.warnings)
    return text + f"; {n_warn} warning{'s' * (n_warn != 1)}"


def needs_combining(report: Report) -> bool:
    """True when two or more rules fail with a fix made of edits (no one printed line can then pass)."""
    return len({rule for rule, _ in _fixes(report)}) >= 2


def combine(recipe: str, overrides: list[str], report: Report, rounds: int = ROUNDS) -> CombinedFix | None:
    """Merge the failing rules' fixes into one ``v4launch validate`` line that passes, if one is found.

    Round by round, the fixes of the rules failing the last candidate are merged in and the candidate validated;
    once one passes, each merged fix is left out in turn, the memory rules' last, and kept out when the candidate
    still passes (a memory fix that reshapes the job often clears a layout or world-size failure too; a backend
    fix can make the memory fix needless).

    Args:
        recipe: the recipe path as the user gave it (relative to the working directory).
        overrides: their dotlist overrides, in order. report: the report of ``recipe`` with ``overrides``.
        rounds: most merged candidates to validate before giving up (each a full in-process load + validate).
    Returns:
        None when fewer than two rules fail with a fix made of edits (nothing is validated then); else the
        ``CombinedFix``, found or not. Never raises for a candidate: one that does not load (``RecipeError``)
        is reported in the result's note.
    """
    if not needs_combining(report):
        return None
    parts: list[tuple[str, list[str]]] = []
    current, done, stalled = report, 0, False
    while done < rounds:
        before = _merged(parts)
        parts += _fixes(current)
        if _merged(parts) == before:  # the rules still failing offer nothing new to merge
            stalled = True
            break
        done += 1
        current = _validate(recipe, overrides, _merged(parts))
        if isinstance(current, str):
            return CombinedFix(False, None, tuple(_merged(parts)), _rules(parts), done, (), current)
        if current.ok:
            return _pruned(recipe, overrides, parts, current, done)
    failing = tuple(dict.fromkeys(v.rule_id for v in current.violations))
    prose = [rule for rule in failing if rule not in {r for r, _ in _fixes(current)}]
    why = (f"{', '.join(prose)}: a fix in words, no edits to merge (see the line above)" if prose else
           "their fixes set what is already merged" if stalled else f"after {done} merged candidates")
    return CombinedFix(False, None, tuple(_merged(parts)), _rules(parts), done, failing,
                       f"with the fixes of {', '.join(_rules(parts))} merged, {', '.join(failing)} still "
                       f"fail{'s' * (len(failing) == 1)}; {why}")


def _rules(parts: list[tuple[str, list[str]]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(rule for rule, _ in parts))


def _validate(recipe: str, overrides: list[str], edits: list[str]) -> Report | str:
    """The report of ``recipe`` with the user's overrides the edits leave and then the edits, or, when that does
    not load, a sentence saying so."""
    from ..recipe_loading import load_recipe
    from ..validators import validate_recipe

    try:
        return validate_recipe(load_recipe(recipe, [*kept_overrides(overrides, edits), *edits]))
    except RecipeError as err:
        return f"the merged edits {' '.join(edits)} do not load ({err.message})"


def _pruned(recipe: str, overrides: list[str], parts: list[tuple[str, list[str]]], report: Report,
            done: int) -> CombinedFix:
    """The passing merge ``parts`` less each rule's fix the candidate passes without, in merge order (``report``:
    the passing candidate's; ``done``: candidates validated so far). The memory rules come last: their fix was
    searched for the recipe before the other fixes, and another fix may make it needless (a cudnn recipe's
    memory plan is the reference path's; ``kernel_backend=triton`` alone fits flash_4n on its 4 nodes, where the
    memory fix had moved it to 8)."""
    dropped: list[str] = []
    for rule in _rules(parts):
        trial = [p for p in parts if p[0] != rule]
        if not trial or set(_merged(trial)) == set(_merged(parts)):  # the last fix left, or edits another sets
            continue
        done += 1
        after = _validate(recipe, overrides, _merged(trial))
        if not isinstance(after, str) and after.ok:
            parts, report = trial, after
            dropped.append(rule)
    edits = _merged(parts)
    return CombinedFix(True, command_line(recipe, overrides, edits), tuple(edits), _rules(parts), done, (),
                       _passes(report, list(_rules(parts)), dropped))
