"""Turn pydantic validation errors on a ``Recipe`` into plain messages: field path, value, rule, where set.

Never shows a raw pydantic dump. Unknown keys get a did-you-mean from the schema itself.
"""

from __future__ import annotations

import difflib
import inspect
import types
from typing import Any, Callable, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from .schema.recipe import Recipe

TOP_LEVEL_EXTRA = ("extends",)
"""Top-level keys the loader handles itself (not schema fields)."""

MAX_LISTED = 12
"""Errors listed in one message; the rest are counted."""


def _child(ann: Any, part: str | int) -> Any:
    """The annotation one step down ``part`` from ``ann`` (None when there is none)."""
    if get_origin(ann) in (Union, types.UnionType):
        for arg in get_args(ann):
            found = _child(arg, part)
            if found is not None:
                return found
        return None
    if get_origin(ann) in (tuple, list) and isinstance(part, int):
        return get_args(ann)[0]
    if inspect.isclass(ann) and issubclass(ann, BaseModel) and isinstance(part, str):
        info = ann.model_fields.get(part)
        return info.annotation if info else None
    return None


def _model(ann: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``ann`` (unwrapping Optional), if any."""
    if get_origin(ann) in (Union, types.UnionType):
        return next((m for m in map(_model, get_args(ann)) if m is not None), None)
    return ann if inspect.isclass(ann) and issubclass(ann, BaseModel) else None


def _annotation_at(loc: tuple) -> Any:
    ann: Any = Recipe
    for part in loc:
        ann = _child(ann, part)
        if ann is None:
            return None
    return ann


def did_you_mean(word: str, choices: list[str]) -> list[str]:
    """The closest of ``choices`` to ``word`` (ties go to a shared first letter); [] when none is close."""
    def score(c: str) -> tuple[float, bool]:
        return difflib.SequenceMatcher(None, word.lower(), c.lower()).ratio(), c[:1].lower() == word[:1].lower()

    ranked = sorted(choices, key=score, reverse=True)
    return ranked[:1] if ranked and score(ranked[0])[0] >= 0.6 else []


def valid_keys(loc: tuple) -> list[str]:
    """Keys the schema accepts in the mapping at ``loc`` (top level includes ``extends``)."""
    model = _model(_annotation_at(loc))
    keys = list(model.model_fields) if model else []
    return keys + list(TOP_LEVEL_EXTRA) if not loc else keys


def field_description(loc: tuple) -> str | None:
    """The schema's description of the field at ``loc``."""
    if not loc:
        return None
    model = _model(_annotation_at(loc[:-1]))
    info = model.model_fields.get(loc[-1]) if model and isinstance(loc[-1], str) else None
    return info.description if info else None


def dotted(loc: tuple) -> str:
    """('curriculum', 'stages', 2, 'cp') → 'curriculum.stages.2.cp'."""
    return ".".join(str(p) for p in loc)


def _value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one(err: dict, where: Callable[[str], str], fallback: str) -> tuple[str, str | None]:
    loc = tuple(err["loc"])
    path = dotted(loc)
    src = where(path) if path else fallback
    src = fallback if src == "default" else src
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        keys = valid_keys(loc[:-1])
        guess = did_you_mean(str(loc[-1]), keys)
        parent = dotted(loc[:-1])
        mean = f" (did you mean '{parent + '.' if parent else ''}{guess[0]}'?)" if guess else ""
        return f"{src}: unknown key '{path}'{mean}", f"valid keys under {parent or 'the top level'}: {', '.join(keys)}"
    if kind == "missing":
        return f"{src}: missing required key '{path}'", field_description(loc)
    if isinstance(err.get("input"), (dict, list)) and kind in ("value_error", "assertion_error"):
        rule = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        return f"{src}: {path or 'recipe'}: {rule}", None
    desc = field_description(loc)
    return f"{src}: {path} = {_value(err.get('input'))}: {msg}", f"{path}: {desc}" if desc else None


def describe_validation_error(error: ValidationError, where: Callable[[str], str], fallback: str) -> tuple[str, str | None]:
    """(message, hint) for a ``Recipe`` validation error.

    Args:
        error: the pydantic error.
        where: maps a dotted field to where it was set ("file:line", "override k=v", "default").
        fallback: shown when a field has no recorded source (usually the recipe file).
    """
    items = error.errors(include_url=False)
    lines, hints = [], []
    for err in items[:MAX_LISTED]:
        line, hint = _one(err, where, fallback)
        lines.append(line)
        if hint:
            hints.append(hint)
    more = f"\n  … and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    if len(lines) == 1:
        return lines[0], hints[0] if hints else None
    head = f"{fallback}: the recipe does not match the schema ({len(items)} errors):"
    return head + "".join(f"\n  {ln}" for ln in lines) + more, hints[0] if hints else None
