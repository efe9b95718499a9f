"""The contract as one check: the ids of the error rules a candidate recipe fails (what a proposed fix must pass).

V4-MEMORY's fix search (``validators/memory_fixes.py``) takes a ``Contract`` as an argument, so that module never
imports the rules: the imports run one way, rules → memory_fixes. The search judges a candidate by
:func:`contract_beyond` of the recipe it fixes: a failure the recipe already had and the candidate leaves exactly
as it was (a cudnn stage V4-KERNEL-AVAILABLE refuses, under a cp fix for memory) is another rule's business and
disqualifies no memory fix; a failure the candidate adds or changes does.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

from ..schema.recipe import Recipe
from .base import RULES, Context, Finding

_SEARCHING: contextvars.ContextVar[bool] = contextvars.ContextVar("memory_fix_search", default=False)

Failure = tuple[str, "int | None", str, str, str]
"""One failing check: (rule id, stage index or None for a recipe-wide rule, field, repr of the value, message)."""


def searching() -> bool:
    """True while :func:`contract_failures` checks a candidate recipe: a rule whose fix text itself runs a
    fix search (V4-EP-FOLD's) gives its plain fix then, so the search never nests."""
    return _SEARCHING.get()


def contract_failures(recipe: Recipe, skip: tuple[str, ...] = ("V4-MEMORY",),
                      known: frozenset[Failure] = frozenset()) -> list[str]:
    """The ids of the error rules (other than ``skip``) that ``recipe`` fails, in registry order, a failure in
    ``known`` (the same rule, stage, field, value and message) not counted.

    A rule that raises counts as failed (the report shows such a crash as a failure too).
    """
    token = _SEARCHING.set(True)
    try:
        return list(dict.fromkeys(f[0] for f in _failures(recipe, skip, known, first_only=True)))
    finally:
        _SEARCHING.reset(token)


_BEYOND: dict[int, tuple[Recipe, Callable[[Recipe], list[str]]]] = {}


def contract_beyond(original: Recipe) -> Callable[[Recipe], list[str]]:
    """The contract a fix of ``original`` must pass: :func:`contract_failures` with ``original``'s own failures
    known, so a candidate is refused only for a failure it adds or changes. One callable per recipe object (the
    whole-recipe search caches its answer per recipe and contract; V4-MEMORY and V4-EP-FOLD then share it)."""
    hit = _BEYOND.get(id(original))
    if hit is not None and hit[0] is original:
        return hit[1]
    if len(_BEYOND) > 8:
        _BEYOND.clear()
    token = _SEARCHING.set(True)
    try:
        known = frozenset(_failures(original, ("V4-MEMORY",), frozenset(), first_only=False))
    finally:
        _SEARCHING.reset(token)

    def contract(recipe: Recipe) -> list[str]:
        return contract_failures(recipe, known=known)

    _BEYOND[id(original)] = (original, contract)
    return contract


def no_other_failure(candidate: Recipe) -> str:
    """How a fix found under :func:`contract_beyond` words what else its ``candidate`` (the recipe with the fix's
    edits) passes: "and no other rule fails", or, where failures the recipe already had remain (the search leaves
    those alone), which rules: a memory fix of a cudnn recipe said "no other rule fails" and, pasted, still
    failed V4-KERNEL-AVAILABLE. One more validation of the candidate (no memory rule)."""
    left = contract_failures(candidate)
    if not left:
        return "and no other rule fails"
    one = len(left) == 1
    return (f"and no rule fails that the recipe did not fail already ({', '.join(left)} still fail{'s' * one}: "
            f"{'its' if one else 'their'} own fix{'es' * (not one)})")


def _failures(recipe: Recipe, skip: tuple[str, ...], known: frozenset[Failure], first_only: bool) -> list[Failure]:
    """The failing checks of ``recipe`` not in ``known``; with ``first_only`` at most one per rule."""
    contexts = {"recipe": [Context(recipe)],
                "stage": [Context(recipe, i) for i in range(len(recipe.curriculum.stages))]}
    failed: list[Failure] = []
    for rule in RULES.values():
        if rule.id in skip or rule.severity != "error":
            continue
        for ctx in contexts[rule.scope]:
            try:
                out = rule.check(ctx)
            except Exception as exc:  # noqa: BLE001 - as the report: a crash is a failure
                out = [Finding("", None, f"crashed: {exc!r}")]
            found = [out] if isinstance(out, Finding) else out if isinstance(out, list) else []
            new = [f for f in ((rule.id, ctx.index, x.field, repr(x.value), x.message) for x in found)
                   if f not in known]
            failed.extend(new[:1] if first_only else new)
            if new and first_only:
                break
    return failed
