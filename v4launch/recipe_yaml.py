"""Bounded YAML 1.2 reading of recipe text: no hang, no unbounded memory, no YAML 1.1 surprises.

A recipe is parsed from libyaml's event stream (``yaml.parse``; libyaml's parser keeps its state
on the heap, so deep nesting cannot overflow the C stack) by a small composer written here,
iteratively, that builds plain Python data and the (line, kind) of every dotted path in one pass.
The composer enforces the limits below, so everything after it (merge, overrides, source map,
pydantic, rules) works on data of bounded size:

* text at most ``MAX_TEXT_BYTES``; nesting at most ``MAX_DEPTH`` levels;
* aliases: at most ``MAX_ALIASES`` uses, and the document expanded (each alias counted with the
  full size of what it names) at most ``MAX_NODES`` nodes — the "billion laughs" recipe of nine
  lines stops here after a few hundred events, naming the line. An alias inside the node it
  names (a cycle) is refused: in YAML it is a structure that never ends;
* one document; tags only from the YAML core schema (``!!str !!int !!float !!bool !!null !!seq
  !!map``); keys are plain text; a key set twice is refused.

Plain scalars resolve by the YAML 1.2 core schema (the one the docs promise): ``null ~``,
``true/false``, decimal / ``0o`` / ``0x`` integers, floats with ``1e-4`` exponents and
``.inf/.nan``. Forms that YAML 1.1 tools (PyYAML's own loaders) read as numbers but YAML 1.2
does not — ``010`` (octal 8 in 1.1), ``1:20`` (base 60: 80), ``8_0``, ``0b101``, ``yes/no/on/off`` —
stay text, so a numeric field refuses them by name (``validators/schema/base.py``) instead of
taking a silently different number. ``010`` is text here although YAML 1.2 would read it as
10: the two YAML versions disagree on it, so it is refused rather than guessed.
Aliased data is copied where it is used (a later override of one copy never changes another).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MAX_TEXT_BYTES = 1 << 20
"""Largest recipe file or override value (1 MiB; shipped recipes are under 5 KiB)."""

MAX_NODES = 50_000
"""Most nodes (mapping entries, list items, scalars) a document may expand to, aliases expanded."""

MAX_ALIASES = 1_000
"""Most alias uses (``*name``) in one document."""

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists (a recipe needs 5)."""

MAX_INT_DIGITS = 40
"""Longest integer literal; longer ones are refused (Python refuses to parse > 4300 digits)."""

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_CORE}{t}" for t in ("str", "int", "float", "bool", "null")}
_NULL = re.compile(r"^(?:null|Null|NULL|~|)$")
_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_INT10 = re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$")
_INT8 = re.compile(r"^0o[0-7]+$")
_INT16 = re.compile(r"^0x[0-9a-fA-F]+$")
_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*|[0-9]+(?=[eE]))(?:[eE][-+]?[0-9]+)?$")
"""YAML 1.2 core floats that are not integers: a '.' or an exponent (``010`` is not read as 10.0)."""
_INF = re.compile(r"^[-+]?\.(?:inf|Inf|INF)$")
_NAN = re.compile(r"^\.(?:nan|NaN|NAN)$")


class YamlLimitError(ValueError):
    """Recipe text the bounded reader refuses; ``line`` is 1-based (0 when unknown)."""

    def __init__(self, message: str, line: int = 0):
        super().__init__(message)
        self.line = line


def as_written(value: Any) -> Any:
    """A field value as a recipe writes it: ``true`` / ``false`` / ``null`` for Python's True / False / None
    (for messages that quote a value; anything else is returned as it is)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return value


def resolve_plain(text: str, line: int = 0) -> Any:
    """The value of an unquoted, untagged scalar under the YAML 1.2 core schema.

    Raises:
        YamlLimitError: an integer literal longer than ``MAX_INT_DIGITS`` digits.
    """
    if _NULL.match(text):
        return None
    if text in _BOOL:
        return _BOOL[text]
    if _INT10.match(text):
        if len(text.lstrip("+-")) > MAX_INT_DIGITS:
            raise YamlLimitError(f"an integer of {len(text.lstrip('+-'))} digits; recipe numbers have at most "
                                 f"{MAX_INT_DIGITS}", line)
        return int(text)
    if _INT8.match(text) or _INT16.match(text):
        if len(text) > MAX_INT_DIGITS:
            raise YamlLimitError(f"an integer literal of {len(text)} characters; at most {MAX_INT_DIGITS}", line)
        return int(text, 8 if text[1] == "o" else 16)
    if _FLOAT.match(text):
        return float(text)
    if _INF.match(text):
        return -math.inf if text.startswith("-") else math.inf
    if _NAN.match(text):
        return math.nan
    return text


def _tagged(tag: str, text: str, line: int) -> Any:
    """A scalar with an explicit core tag (``!!int "8"`` asks for the number 8)."""
    kind = tag[len(_CORE):]
    if kind == "str":
        return text
    value = resolve_plain(text, line)
    wanted = {"int": int, "float": (int, float), "bool": bool, "null": type(None)}[kind]
    if isinstance(value, bool) and kind != "bool" or not isinstance(value, wanted):
        raise YamlLimitError(f"!!{kind} {text!r} is not a YAML 1.2 {kind}", line)
    return float(value) if kind == "float" else value


@dataclass
class _Open:
    """A mapping or list being composed: its value, path, anchor and pending key."""

    value: Any
    path: str
    anchor: str | None
    start_nodes: int
    line: int
    key: str | None = None
    key_line: int = 0
    seen: dict[str, int] = field(default_factory=dict)


@dataclass
class _Anchor:
    value: Any
    nodes: int
    line: int
    text: str | None = None  # a scalar's source text (what the alias means as a key)


def _copy(value: Any) -> Any:
    """Deep copy of plain YAML data (bounded: its size was counted when it was composed)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _kind(value: Any) -> str:
    return "map" if isinstance(value, dict) else "seq" if isinstance(value, list) else "scalar"


def _record_copy(lines: dict[str, tuple[int, str]], path: str, value: Any, line: int) -> None:
    """Every path inside an aliased value was set where the alias is used."""
    stack = [(path, value)]
    while stack:
        prefix, val = stack.pop()
        items = val.items() if isinstance(val, dict) else enumerate(val) if isinstance(val, list) else ()
        for k, v in items:
            sub = f"{prefix}.{k}"
            lines[sub] = (line, _kind(v))
            stack.append((sub, v))


class _Composer:
    """Builds plain data from parse events under the module's limits (see the module docstring)."""

    def __init__(self, track_lines: bool = True) -> None:
        self.track_lines = track_lines
        self.stack: list[_Open] = []
        self.anchors: dict[str, _Anchor] = {}
        self.open_anchors: set[str] = set()
        self.nodes = 0
        self.aliases = 0
        self.lines: dict[str, tuple[int, str]] = {}
        self.root: Any = None
        self.done = False

    def _count(self, n: int, line: int) -> None:
        self.nodes += n
        if self.nodes > MAX_NODES:
            raise YamlLimitError(f"the document expands to more than {MAX_NODES} nodes (aliases expanded); "
                                 "a recipe needs a few hundred", line)

    def _child_path(self, line: int) -> str | None:
        """Dotted path of the next value in the open container (None at the root)."""
        if not self.stack:
            return None
        top = self.stack[-1]
        if isinstance(top.value, list):
            return f"{top.path}.{len(top.value)}" if top.path else str(len(top.value))
        return f"{top.path}.{top.key}" if top.path else top.key

    def _record(self, path: str | None, value: Any, line: int) -> None:
        """Note the line that sets ``path`` (a mapping entry: its key's line) before its children's."""
        if path is not None and self.track_lines:
            top = self.stack[-1]
            self.lines[path] = (top.key_line if isinstance(top.value, dict) else line, _kind(value))

    def _place(self, value: Any, line: int, record: bool = True, aliased: bool = False) -> None:
        """Attach a finished value to its parent (or make it the root)."""
        if self.done:
            raise YamlLimitError("a recipe is one YAML document; found a second one", line)
        if not self.stack:
            self.root, self.done = value, True
            return
        path = self._child_path(line)
        if record:
            self._record(path, value, line)
        if aliased and self.track_lines:
            _record_copy(self.lines, path, value, line)
        top = self.stack[-1]
        if isinstance(top.value, list):
            top.value.append(value)
        else:
            top.value[top.key] = value
            top.key = None

    def scalar(self, ev: yaml.ScalarEvent) -> None:
        line = ev.start_mark.line + 1
        self._count(1, line)
        if ev.tag not in (None, "!") and ev.tag not in _SCALAR_TAGS:
            raise YamlLimitError(f"tag {ev.tag!r} is not allowed in a recipe (YAML core tags only: "
                                 "!!str !!int !!float !!bool !!null)", line)
        if ev.tag in _SCALAR_TAGS:
            value = _tagged(ev.tag, ev.value, line)
        elif ev.implicit[0] and ev.tag is None:
            value = resolve_plain(ev.value, line)
        else:
            value = ev.value
        top = self.stack[-1] if self.stack else None
        if top is not None and isinstance(top.value, dict) and top.key is None:
            self._key(top, ev.value, line)
            return
        self._anchor(ev.anchor, value, 1, line, ev.value)
        self._place(value, line)

    def _key(self, top: _Open, key: str, line: int) -> None:
        if key in top.seen:
            raise YamlLimitError(f"duplicate key {key!r} (first set on line {top.seen[key]})", line)
        top.seen[key] = line
        top.key, top.key_line = key, line

    def _anchor(self, name: str | None, value: Any, nodes: int, line: int, text: str | None = None) -> None:
        if name is not None:
            self.anchors[name] = _Anchor(value, nodes, line, text)

    def start(self, ev: yaml.NodeEvent, container: Any) -> None:
        line = ev.start_mark.line + 1
        self._count(1, line)
        top = self.stack[-1] if self.stack else None
        if top is not None and isinstance(top.value, dict) and top.key is None:
            raise YamlLimitError("a mapping key must be plain text, not a list or mapping", line)
        if ev.tag not in (None, "!", f"{_CORE}seq", f"{_CORE}map"):
            raise YamlLimitError(f"tag {ev.tag!r} is not allowed in a recipe (YAML core tags only)", line)
        if len(self.stack) >= MAX_DEPTH:
            raise YamlLimitError(f"nesting deeper than {MAX_DEPTH} levels", line)
        path = self._child_path(line)
        if path is not None:
            self._record(path, container, line)
        if ev.anchor is not None:
            self.open_anchors.add(ev.anchor)
        self.stack.append(_Open(container, path or "", ev.anchor, self.nodes, line))

    def end(self, ev: yaml.Event) -> None:
        done = self.stack.pop()
        if done.anchor is not None:
            self.open_anchors.discard(done.anchor)
            self._anchor(done.anchor, done.value, self.nodes - done.start_nodes + 1, done.line)
        self._place(done.value, done.line, record=False)

    def alias(self, ev: yaml.AliasEvent) -> None:
        line = ev.start_mark.line + 1
        self.aliases += 1
        if self.aliases > MAX_ALIASES:
            raise YamlLimitError(f"more than {MAX_ALIASES} aliases", line)
        if ev.anchor in self.open_anchors:
            raise YamlLimitError(f"alias *{ev.anchor} is inside the node &{ev.anchor} it names (a structure "
                                 "that never ends)", line)
        target = self.anchors.get(ev.anchor)
        if target is None:
            raise YamlLimitError(f"alias *{ev.anchor} names no anchor defined before it", line)
        top = self.stack[-1] if self.stack else None
        if top is not None and isinstance(top.value, dict) and top.key is None:
            if target.text is None:
                raise YamlLimitError("a mapping key must be plain text, not an alias of a list or mapping", line)
            self._count(1, line)
            self._key(top, target.text, line)
            return
        self._count(target.nodes, line)
        self._place(_copy(target.value), line, aliased=True)


def compose(text: str, lines: bool = True) -> tuple[Any, dict[str, tuple[int, str]]]:
    """Parse ``text`` (one YAML document) into plain data and the (line, kind) of each dotted path.

    Returns:
        (data, lines): ``data`` is None for an empty document; ``lines`` maps ``a.b.0`` to the
        1-based line that set it and its kind ("map", "seq" or "scalar"), empty when ``lines`` is
        False (an override's source is the override itself). Linear in the expanded size.

    Raises:
        YamlLimitError: a limit, a forbidden tag, a duplicate key, a cycle, a second document.
        yaml.YAMLError: libyaml's syntax errors (with ``problem_mark``).
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise YamlLimitError(f"{len(text.encode('utf-8', 'surrogatepass'))} bytes; at most {MAX_TEXT_BYTES} "
                             f"({MAX_TEXT_BYTES >> 10} KiB)", 1)
    comp = _Composer(lines)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for ev in yaml.parse(text, Loader=loader):
        if isinstance(ev, yaml.ScalarEvent):
            comp.scalar(ev)
        elif isinstance(ev, yaml.MappingStartEvent):
            comp.start(ev, {})
        elif isinstance(ev, yaml.SequenceStartEvent):
            comp.start(ev, [])
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            comp.end(ev)
        elif isinstance(ev, yaml.AliasEvent):
            comp.alias(ev)
        elif isinstance(ev, yaml.DocumentStartEvent) and comp.done:
            raise YamlLimitError("a recipe is one YAML document; found a second one", ev.start_mark.line + 1)
    return comp.root, comp.lines


def yaml_names_in(path: Path) -> list[str] | None:
    """The first five ``*.yaml`` names in directory ``path`` (sorted), or None when ``path`` is not a
    directory (or a name the OS refuses: too long, a NUL byte)."""
    try:
        return sorted(c.name for c in path.glob("*.yaml"))[:5] if path.is_dir() else None
    except (OSError, ValueError):
        return None
