"""Turn pydantic validation errors on a ``Recipe`` into plain messages: field path, value, rule, where set.

Never shows a raw pydantic dump. Unknown keys get a did-you-mean from the schema itself.
"""

from __future__ import annotations

import difflib
import inspect
import re
import types
from typing import Any, Callable, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from .peer_names import peer_name, peer_without_equivalent
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


SUGGEST_MAX_CHARS = 200
"""Longer words get no suggestion: no field or value name is that long, and the matcher is quadratic in it."""


def did_you_mean(word: str, choices: list[str]) -> list[str]:
    """The closest of ``choices`` to ``word`` (ties go to a shared first letter); [] when none is close or
    ``word`` is longer than :data:`SUGGEST_MAX_CHARS`."""
    if len(word) > SUGGEST_MAX_CHARS:
        return []

    def score(c: str) -> tuple[float, bool]:
        return difflib.SequenceMatcher(None, word.lower(), c.lower()).ratio(), c[:1].lower() == word[:1].lower()

    ranked = sorted(choices, key=score, reverse=True)
    return ranked[:1] if ranked and score(ranked[0])[0] >= 0.6 else []


def all_field_paths(ann: Any = Recipe, prefix: tuple = ()) -> list[tuple]:
    """Every field of the schema as a path tuple; list items appear as index ``"N"``."""
    model = _model(ann)
    out: list[tuple] = []
    for name, info in (model.model_fields.items() if model else ()):
        here = (*prefix, name)
        out.append(here)
        inner = info.annotation
        if get_origin(_strip_optional(inner)) in (tuple, list) and _model(get_args(_strip_optional(inner))[0]):
            out += all_field_paths(get_args(_strip_optional(inner))[0], (*here, "N"))
        elif _model(inner):
            out += all_field_paths(inner, here)
    return out


def _strip_optional(ann: Any) -> Any:
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else ann
    return ann


def misplaced(loc: tuple) -> list[str]:
    """Where else in the schema the leaf name of ``loc`` is a field (``model.n_hash_layers`` →
    ``model.moe.n_hash_layers``); the stage index of ``loc`` fills ``N``; nearest sections first."""
    leaf = str(loc[-1])
    index = next((p for p in loc if isinstance(p, int)), None)
    found = []
    for path in all_field_paths():
        if path[-1] == leaf and path[:-1] != tuple("N" if isinstance(p, int) else p for p in loc[:-1]):
            shared = next((i for i, (a, b) in enumerate(zip(path, loc)) if a != b), min(len(path), len(loc)))
            text = dotted(tuple(index if p == "N" and index is not None else p for p in path))
            found.append((-shared, len(path), text))
    return [text for _, _, text in sorted(found)]


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
    """The value as the message shows it: its repr, cut at 60 characters; YAML's null (``key:``, ``key=``, ``~``)
    as "null (no value)", not Python's None."""
    text = "null (no value)" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


BOUND_WORDS = {"greater_than": "more than", "greater_than_equal": "at least", "less_than": "less than",
               "less_than_equal": "at most"}


def _unknown_key(loc: tuple, src: str) -> tuple[str, str]:
    """Message and hint of an unknown key: a peer launcher's name, the same leaf elsewhere, or a near spelling."""
    path, parent = dotted(loc), dotted(loc[:-1])
    keys = valid_keys(loc[:-1])
    valid = f"valid keys under {parent or 'the top level'}: {', '.join(keys)}"
    peer, absent = peer_name(str(loc[-1])), peer_without_equivalent(str(loc[-1]))
    if absent is not None:
        return f"{src}: unknown key '{path}': {loc[-1]} is {absent[0]} name; there is no such setting here: " \
               f"{absent[1]}", "remove it"
    if peer is not None:
        whose, ours = peer
        index = next((p for p in loc if isinstance(p, int)), None)
        ours = ours.replace(".N.", f".{index}.") if index is not None else ours
        return f"{src}: unknown key '{path}': {loc[-1]} is {whose} name; here it is {ours}", f"rename it to {ours}"
    elsewhere = misplaced(loc)
    if elsewhere:
        return f"{src}: unknown key '{path}' (did you mean '{elsewhere[0]}'? the key lives there)", \
            f"move it to {elsewhere[0]}" + (f" (also a key: {', '.join(elsewhere[1:3])})" if elsewhere[1:] else "")
    guess = did_you_mean(str(loc[-1]), keys)
    mean = f" (did you mean '{parent + '.' if parent else ''}{guess[0]}'?)" if guess else ""
    return f"{src}: unknown key '{path}'{mean}", valid


def _fix(err: dict, path: str) -> str | None:
    """The concrete fix of a bound, length or choice error (printed after "hint: ")."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in BOUND_WORDS:
        bound = next(iter(ctx.values()), None)
        return f"set {path} to a value {BOUND_WORDS[kind]} {bound}"
    if kind in ("too_long", "string_too_long"):
        return f"shorten {path} to at most {ctx.get('max_length')} {'characters' if 'string' in kind else 'items'}"
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        choices = re.findall(r"'([^']*)'", expected) or re.split(r", | or ", expected)  # strings quoted, numbers not
        guess = did_you_mean(str(err.get("input")), choices) if isinstance(err.get("input"), str) else []
        return f"{'did you mean ' + repr(guess[0]) + '? ' if guess else ''}set {path} to one of: {', '.join(choices)}"
    return None


_DOTTED_FIELD = re.compile(r"\b[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+\b")


def _named_field_sources(msg: str, where: Callable[[str], str], shown: str) -> str:
    """`` (optimizer.lr: override optimizer.lr=2e-4)`` for the dotted fields a section-level message names
    that were set somewhere other than the location already shown (e.g. by an override): a rule between two
    fields is reported at their section, and the value that broke it may come from the command line."""
    found = []
    for name in dict.fromkeys(_DOTTED_FIELD.findall(msg)):
        src = where(name)
        if src not in ("default", shown):
            found.append(f"{name}: {src}")
    return f" ({'; '.join(found)})" if found else ""


_PLAIN = {  # pydantic's type-error wording -> the recipe's words (bounds keep pydantic's, which name the bound)
    "tuple_type": "must be a list (YAML: [a, b, ...]; an override: key=[a,b])",
    "list_type": "must be a list (YAML: [a, b, ...]; an override: key=[a,b])",
    "too_short": "needs at least {min_length} item(s), got {actual_length}",
    "too_long": "takes at most {max_length} item(s), got {actual_length}",
    "finite_number": "must be a finite number (YAML reads 1e400, .inf and .nan as infinity / not-a-number)",
    "int_parsing": "must be a whole number",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number (no fractional part)",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
}


def plain_message(kind: str, msg: str, ctx: dict | None) -> str:
    """The user-facing sentence of one pydantic error: :data:`_PLAIN`'s wording for type errors (filled from
    the error's ``ctx``), else pydantic's own message without its "Value error, " prefixes."""
    template = _PLAIN.get(kind)
    if template is not None:
        try:
            return template.format(**(ctx or {}))
        except (KeyError, IndexError):
            pass
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _one(err: dict, where: Callable[[str], str], fallback: str) -> tuple[str, str | None]:
    loc = tuple(err["loc"])
    path = dotted(loc)
    src = where(path) if path else fallback
    src = fallback if src == "default" else src
    kind, msg = err["type"], plain_message(err["type"], err["msg"], err.get("ctx"))
    if kind == "extra_forbidden":
        return _unknown_key(loc, src)
    if kind == "missing":
        return f"{src}: missing required key '{path}'", field_description(loc)
    if isinstance(err.get("input"), (dict, list)) and kind in ("value_error", "assertion_error"):
        return f"{src}: {path or 'recipe'}: {msg}{_named_field_sources(msg, where, src)}", None
    if kind in ("model_type", "model_attributes_type", "dict_type") and _model(_annotation_at(loc)) is not None:
        keys = valid_keys(loc)
        return (f"{src}: {path} = {_value(err.get('input'))}: {path} is a section of keys ({', '.join(keys)}), "
                "not a single value"), (f"set its keys, e.g. {path}.{keys[0]}=... on the command line, or "
                                        f"{path}: {{{keys[0]}: ...}} in the YAML")
    desc = field_description(loc)
    fix = _fix(err, path)
    about = f"{path}: {desc}" if desc else None
    hint = f"{fix}. {about}" if fix and about else fix or about
    return f"{src}: {path} = {_value(err.get('input'))}: {msg}", hint


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
