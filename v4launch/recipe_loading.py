"""Load a recipe: YAML (+ ``extends``) → omegaconf (merge, overrides, interpolation) → pydantic ``Recipe``.

    loaded = load_recipe("recipes/flash_4n.yaml", ["parallel.cp=8"])
    loaded.recipe              # validated Recipe
    loaded.resolved            # plain dict: every field's effective value, interpolations resolved, no `extends`
    loaded.source_of("parallel.cp")   # "override parallel.cp=8" | "recipes/flash_4n.yaml:12" | "default"
    loaded.to_yaml()           # what gets frozen into a run directory

A recipe may name a base with ``extends: flash.yaml`` (resolved relative to the file); the child's mappings merge
into the base's, lists replace (omegaconf's merge rules, done on plain data because omegaconf is slow; omegaconf
is imported only to resolve ``${...}``). Overrides are ``dotted.key=value`` with YAML values (list indices allowed:
``curriculum.stages.0.steps=10``). Every failure is a ``RecipeError`` (exit 2) naming the file and line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .errors import RecipeError
from .validators.schema.limits import MAX_TEXT_CHARS
from .recipe_yaml import MAX_DEPTH, MAX_TEXT_BYTES, YamlLimitError, compose, yaml_names_in
from .validators.schema import Recipe
from .validators.schema_errors import describe_validation_error

EXTENDS_KEY = "extends"
_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
MAX_EXTENDS = 8
"""Longest chain of ``extends`` (a recipe, its base, the base's base, …)."""


def display_path(path: Path) -> str:
    """``path`` relative to the working directory when inside it, else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path.as_posix()
    return path.as_posix() if rel.startswith("..") else rel


def _kind(value: Any) -> str:
    return "map" if isinstance(value, dict) else "seq" if isinstance(value, (list, tuple)) else "scalar"


def _yaml_problem(shown: str, err: Exception) -> RecipeError:
    """A RecipeError naming the file and line of a YAML syntax error or a refused construct."""
    if isinstance(err, YamlLimitError):
        where = f"{shown}:{err.line}" if err.line else shown
        return RecipeError(f"{where}: refused: {err}",
                           hint="recipes are plain YAML 1.2 (no custom tags, no self-referencing or exploding "
                                "aliases); see docs/validate.md \"Input limits\"")
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    line = mark.line + 1 if mark is not None else 1
    problem = getattr(err, "problem", None) or _first_line(err)
    return RecipeError(f"{shown}:{line}: invalid YAML: {problem}", hint="check indentation, colons and quotes on that line")


def read_yaml(path: Path) -> tuple[dict, dict[str, tuple[int, str]]]:
    """Parse one recipe file: its mapping and the (line, kind) of every dotted path in it."""
    shown = display_path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_TEXT_BYTES + 1)
        if len(raw) > MAX_TEXT_BYTES:
            raise RecipeError(f"{shown}: refused: larger than {MAX_TEXT_BYTES >> 10} KiB (shipped recipes are under 5 KiB)",
                              hint="a recipe holds settings, not data; point data.paths at the data instead")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"cannot read {shown}: {err}", hint="check the path and that the file is UTF-8 text") from None
    try:
        data, lines = compose(text)
    except (yaml.YAMLError, YamlLimitError) as err:
        raise _yaml_problem(shown, err) from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__} ({_first_line(repr(data))[:60]})"
        raise RecipeError(f"{shown}: a recipe is a mapping of sections (name:, model:, parallel:, …), got {got}",
                          hint="start from a shipped recipe, e.g. recipes/flash.yaml")
    return data, lines


class _Where:
    """One node of the source trie: where this path was set (None: only its descendants were) and its children."""

    __slots__ = ("where", "kind", "children")

    def __init__(self) -> None:
        self.where: str | None = None
        self.kind = "map"
        self.children: dict[str, _Where] = {}


class SourceMap:
    """Where each dotted path got its value: the last file (base → child) or override that set it. A trie keyed
    by path parts: recording and lookup are linear in the recipe's size (a 20,000-entry list: milliseconds)."""

    def __init__(self) -> None:
        self._root = _Where()

    def _set(self, path: str, where: str, kind: str, node: _Where | None = None) -> _Where:
        """Record ``path`` (relative to ``node``, default the root); return its trie node."""
        node = node or self._root
        for part in path.split("."):
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = _Where()
            node = child
        if kind != "map":  # a list or scalar replaces everything a base set below it
            node.children.clear()
        node.where, node.kind = where, kind
        return node

    def add_file(self, file: Path, lines: dict[str, tuple[int, str]]) -> None:
        shown = display_path(file)
        for path, (line, kind) in lines.items():
            self._set(path, f"{shown}:{line}", kind)

    def add_override(self, key: str, value: Any, label: str) -> None:
        stack = [(self._set(key, label, _kind(value)), value)]
        while stack:
            node, val = stack.pop()
            children = val.items() if isinstance(val, dict) else enumerate(val) if isinstance(val, list) else ()
            for k, v in children:
                stack.append((self._set(str(k), label, _kind(v), node), v))

    def lookup(self, dotted: str) -> str:
        """Source of ``dotted`` (``a.b[2].c`` or ``a.b.2.c``).

        A field absent from the nearest mapping that was set is a default; a field inside a list
        (or scalar) set as a whole comes from where that list was set. A key that nothing set itself
        but that has set descendants (an unknown top-level key from ``foo.bar=1``) comes from where
        its first descendant was set.
        """
        key = re.sub(r"\[(\d+)\]", r".\1", dotted).strip(".")
        node, found = self._root, None
        parts = key.split(".")
        for n, part in enumerate(parts, 1):
            node = node.children.get(part)
            if node is None:
                break
            if node.where is not None:
                found = (node.where, node.kind, n)
        if node is not None and node.where is None:
            below = self._first_below(node)
            if below is not None:
                return below
        if found is None:
            return "default"
        where, kind, n = found
        return where if n == len(parts) or kind != "map" else "default"

    @staticmethod
    def _first_below(node: _Where) -> str | None:
        stack = list(reversed(node.children.values()))
        while stack:
            child = stack.pop()
            if child.where is not None:
                return child.where
            stack.extend(reversed(child.children.values()))
        return None


@dataclass(frozen=True)
class LoadedRecipe:
    """A validated recipe with its resolved values and where each value was set."""

    recipe: Recipe
    resolved: dict
    path: Path
    sources: SourceMap = field(repr=False)
    overrides: tuple[str, ...] = ()  # the dotlist overrides applied, in order (CLI options included)

    def source_of(self, dotted_field: str) -> str:
        """Where ``dotted_field`` was set: ``"recipes/x.yaml:12"``, ``"override k=v"`` or ``"default"``."""
        return self.sources.lookup(dotted_field)

    def repeated_overrides(self) -> list[str]:
        """One line per override key given more than once, e.g. ``"optimizer.lr is given 2 times (2e-4, then 3e-3): the last, 3e-3, applies"``."""
        values: dict[str, list[str]] = {}
        for text in self.overrides:
            key, _, raw = text.partition("=")
            values.setdefault(key.strip(), []).append(raw.strip())
        return [f"{key} is given {len(vals)} times ({', then '.join(vals)}): the last, {vals[-1]}, applies"
                for key, vals in values.items() if len(vals) > 1]

    def to_yaml(self) -> str:
        """The resolved recipe as YAML (loads back to the same ``Recipe``)."""
        return yaml.safe_dump(self.resolved, sort_keys=False, default_flow_style=None, width=120)


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False for a name the OS refuses (too long, NUL byte)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _find(path: str | Path) -> Path:
    """``path`` itself, else a shipped recipe of that name (``flash_4n`` or ``flash_4n.yaml``)."""
    p = Path(path)
    if _is_file(p):
        return p.resolve()
    if p.parent == Path("."):
        shipped = Path(__file__).resolve().parent.parent / "recipes"
        for cand in (shipped / p.name, shipped / f"{p.name}.yaml"):
            if _is_file(cand):
                return cand.resolve()
        try:
            from importlib.resources import files  # only for a name that is no file here: not at import time

            pkg = files("v4launch.recipes")
            for name in (p.name, f"{p.name}.yaml"):
                if _is_file(Path(str(pkg.joinpath(name)))):
                    return Path(str(pkg.joinpath(name))).resolve()
        except (ModuleNotFoundError, TypeError):
            pass
    if (inside := yaml_names_in(p)) is not None:  # a directory: say so, and name recipes in it
        raise RecipeError(f"recipe path is a directory: {_short(str(path))}", hint="give the path of a .yaml recipe "
                          f"file{', e.g. one of these: ' + ', '.join(inside) if inside else ' (this one has none)'}")
    raise RecipeError(f"recipe not found: {_short(str(path))}",
                      hint="give the path of a .yaml recipe, or the name of a shipped one: " + (", ".join(sorted(
                          f.stem for f in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))) or "flash_4n"))


def _merge(base: dict, child: dict) -> dict:
    """omegaconf merge semantics on plain data: mappings merge recursively, anything else replaces."""
    out = dict(base)
    for key, value in child.items():
        old = out.get(key)
        out[key] = _merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return out


def _chain(path: Path, sources: SourceMap, seen: tuple[Path, ...] = ()) -> dict:
    """Load ``path`` and its ``extends`` bases (base first), merged into one mapping."""
    data, lines = read_yaml(path)
    merged: dict = {}
    base = data.pop(EXTENDS_KEY, None)
    where = f"{display_path(path)}:{lines.get(EXTENDS_KEY, (1, ''))[0]}"
    if base is not None:
        if not isinstance(base, str) or not base:
            raise RecipeError(f"{where}: extends must be a file name, got {base!r}", hint="e.g. extends: flash.yaml")
        base_path = (path.parent / base).resolve()
        if not base_path.is_file():
            raise RecipeError(f"{where}: base recipe not found: {base} (looked at {display_path(base_path)})",
                              hint="extends is resolved relative to the file that names it")
        if base_path in (*seen, path):
            cycle = " → ".join(display_path(p) for p in (*seen, path, base_path))
            raise RecipeError(f"{where}: recipe extends itself: {cycle}", hint="remove one of the extends: keys")
        if len(seen) + 1 >= MAX_EXTENDS:
            raise RecipeError(f"{where}: more than {MAX_EXTENDS} recipes chained by extends",
                              hint="flatten the chain: extend a shipped recipe and set the differences")
        merged = _chain(base_path, sources, (*seen, path))
    sources.add_file(path, {k: v for k, v in lines.items() if k != EXTENDS_KEY})
    return _merge(merged, data)


def _short(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters for a message (an override may be a megabyte long)."""
    return text if len(text) <= limit else f"{text[:limit - 20]}… ({len(text)} characters)"


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _set_path(data: dict, key: str, value: Any) -> None:
    """Set dotted ``key`` (list items by index) like ``OmegaConf.update(..., merge=True)``."""
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if not isinstance(node, (dict, list)):
            raise IndexError(f"{'.'.join(parts[:i])} is a single value, not a mapping or list; no key {part}")
        if isinstance(node, list):
            if not part.isdigit() or len(part) > 9 or int(part) >= len(node):
                raise IndexError(f"{'.'.join(parts[:i])} has {len(node)} items; no index {part}")
            idx: Any = int(part)
        else:
            idx = part
            if not last and not isinstance(node.get(idx), (dict, list)):
                node[idx] = {}
        if last:
            old = node[idx] if isinstance(node, list) else node.get(idx)
            node[idx] = _merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
        else:
            node = node[idx]


def _apply_override(data: dict, text: str, sources: SourceMap) -> None:
    """Apply one ``dotted.key=value`` override (value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _OVERRIDE_KEY.match(key):
        raise RecipeError(f"bad override '{_short(text)}': expected dotted.key=value, list indices from 0 (none negative)",
                          hint="keys are dotted paths into the recipe; list items by index: curriculum.stages.0.steps=10")
    if key == EXTENDS_KEY:
        raise RecipeError(f"bad override '{text}': extends cannot be overridden", hint="edit the recipe's extends: line")
    if key.count(".") >= MAX_DEPTH:
        raise RecipeError(f"bad override '{_short(text)}': a key of {key.count('.') + 1} parts; recipes nest at most "
                          f"{MAX_DEPTH} levels", hint="keys are dotted paths into the recipe, e.g. parallel.cp=8")
    try:
        value = compose(raw, lines=False)[0] if raw.strip() else None
    except (yaml.YAMLError, YamlLimitError) as err:
        raise RecipeError(f"bad override '{_short(text)}': {_first_line(err)}",
                          hint="the value is YAML 1.2: a number, text, [a, b] or {k: v}; no custom tags or "
                               "self-referencing aliases") from None
    try:
        _set_path(data, key, value)
    except IndexError as err:
        raise RecipeError(f"bad override '{_short(text)}': {_first_line(err)}",
                          hint="check the key path exists (list indices must be in range) and the value is YAML") from None
    sources.add_override(key, value, f"override {_short(text)}")


MAX_INTERPOLATIONS = 16
"""Most ``${...}`` in one recipe. Nested string interpolations multiply lengths (``b: ${a}${a}${a}``),
so with at most 16 of them and strings of at most 4096 characters a resolved string stays near 1 MiB."""

MAX_INTERPOLATED_NODES = 4000
"""Largest recipe (values counted) resolved by omegaconf, which costs ~0.4 ms per value; shipped
recipes have ~200 values."""


def _interpolation_load(data: Any) -> tuple[int, int, int]:
    """(values, ``${`` occurrences + ``???`` markers, longest string) of plain data, iteratively."""
    nodes = marks = longest = 0
    stack = [data]
    while stack:
        value = stack.pop()
        nodes += 1
        if isinstance(value, str):
            marks += value.count("${") + (value == "???")
            longest = max(longest, len(value))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return nodes, marks, longest


def _check_interpolation_load(data: dict, file: Path) -> bool:
    """True when ``data`` needs omegaconf; refuses a recipe too large to resolve within the time and memory bounds."""
    nodes, marks, longest = _interpolation_load(data)
    if not marks:
        return False
    problem = (f"{marks} interpolations (at most {MAX_INTERPOLATIONS})" if marks > MAX_INTERPOLATIONS else
               f"{nodes} values (at most {MAX_INTERPOLATED_NODES} with interpolations)" if nodes > MAX_INTERPOLATED_NODES else
               f"a string of {longest} characters (at most {MAX_TEXT_CHARS} with interpolations)" if longest > MAX_TEXT_CHARS
               else None)
    if problem:
        raise RecipeError(f"{display_path(file)}: refused: the recipe uses ${{...}} interpolation and has {problem}",
                          hint="write the values out instead of interpolating them, or shorten the recipe")
    return True


def _interpolate(data: dict, sources: SourceMap, file: Path) -> dict:
    """Resolve ``${...}`` interpolations with omegaconf (imported only when a recipe uses them)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(data), resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        key = str(getattr(err, "full_key", None) or "")
        where = sources.lookup(key) if key else display_path(file)
        raise RecipeError(f"{where}: cannot resolve {key or 'the recipe'}: {_first_line(err)}",
                          hint="interpolations look like ${section.key} or ${oc.env:NAME,default}; the target must exist") from None


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> LoadedRecipe:
    """Load, compose, override, resolve and validate a recipe.

    Raises:
        RecipeError: unreadable file, bad YAML, bad ``extends``, bad override, unresolvable
            interpolation, or a schema error (field path, value, rule, file:line).
    """
    file = _find(path)
    sources = SourceMap()
    data = _chain(file, sources)
    for text in overrides:
        _apply_override(data, text, sources)
    if _check_interpolation_load(data, file):
        data = _interpolate(data, sources, file)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        message, hint = describe_validation_error(err, sources.lookup, display_path(file))
        raise RecipeError(message, hint) from None
    resolved = recipe.model_dump(mode="json", exclude_computed_fields=True)
    return LoadedRecipe(recipe, resolved, file, sources, tuple(overrides))
