"""The contract as one check: the ids of the error rules a candidate recipe fails (what a proposed fix must pass).

V4-MEMORY's fix search (``validators/memory_fixes.py``) takes :func:`contract_failures` as an argument, so that
module never imports the rules: the imports run one way, rules → memory_fixes.
"""

from __future__ import annotations

import contextvars

from ..schema.recipe import Recipe
from .base import RULES, Context, Finding

_SEARCHING: contextvars.ContextVar[bool] = contextvars.ContextVar("memory_fix_search", default=False)


def searching() -> bool:
    """True while :func:`contract_failures` checks a candidate recipe: a rule whose fix text itself runs a
    fix search (V4-EP-FOLD's) gives its plain fix then, so the search never nests."""
    return _SEARCHING.get()


def contract_failures(recipe: Recipe, skip: tuple[str, ...] = ("V4-MEMORY",)) -> list[str]:
    """The ids of the error rules (other than ``skip``) that ``recipe`` fails, in registry order.

    A rule that raises counts as failed (the report shows such a crash as a failure too).
    """
    token = _SEARCHING.set(True)
    try:
        return _failures(recipe, skip)
    finally:
        _SEARCHING.reset(token)


def _failures(recipe: Recipe, skip: tuple[str, ...]) -> list[str]:
    contexts = {"recipe": [Context(recipe)],
                "stage": [Context(recipe, i) for i in range(len(recipe.curriculum.stages))]}
    failed = []
    for rule in RULES.values():
        if rule.id in skip or rule.severity != "error":
            continue
        for ctx in contexts[rule.scope]:
            try:
                out = rule.check(ctx)
            except Exception:  # noqa: BLE001 - as the report: a crash is a failure
                out = [None]
            if isinstance(out, Finding) or (isinstance(out, list) and out):
                failed.append(rule.id)
                break
    return failed
