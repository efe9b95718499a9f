"""Write a recipe's overrides to a file: ``v4launch validate RECIPE k=v ... --write NEW.yaml``.

The new file ``extends`` the original and sets exactly the overridden fields, so it reads as the
diff it is and follows later edits of the original:

    # flash_4n with 1 change, written by `v4launch validate recipes/flash_4n.yaml cluster.nodes=8 --write f8.yaml`
    #   cluster.nodes: 4 -> 8 (was set at recipes/flash_4n.yaml:21)
    extends: flash_4n.yaml
    cluster:
      nodes: 8

Lists replace as a whole under ``extends`` (recipe_loading's merge rules), so an override of a list
item (``curriculum.stages.0.cp=8``) writes the whole list, copied from the file that sets it with its
comments and flow style kept. Writing to the recipe itself (``--write`` naming RECIPE, with
``--force``) edits it in place instead: only the overridden values change, every comment stays.
YAML goes through ruamel.yaml's round-trip mode, never hand-written text, and the file written is
loaded back and must resolve to exactly the recipe that was validated.
"""

from __future__ import annotations

import copy
import io
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UsageError, V4LaunchError
from .recipe_loading import EXTENDS_KEY, LoadedRecipe, SourceMap, _chain, display_path, load_recipe
from .recipe_yaml import as_written, compose


@dataclass(frozen=True)
class WrittenRecipe:
    """What ``write_overrides`` wrote: the file, the recipe it extends (None when edited in place) and, per
    overridden field, (dotted key, value before, value now, where the value before was set)."""

    path: Path
    extends: str | None
    changes: tuple[tuple[str, Any, Any, str], ...]


def _yaml() -> Any:
    from ruamel.yaml import YAML  # only for --write: validate's own reading is recipe_yaml's bounded reader

    rt = YAML()  # round-trip: comments, key order, flow style and quoting survive
    rt.width = 120
    rt.preserve_quotes = True
    rt.indent(mapping=2, sequence=4, offset=2)
    return rt


def _rt_load(path: Path) -> Any:
    """``path`` parsed by ruamel's round-trip loader (the file already passed recipe_loading's limits)."""
    return _yaml().load(path.read_text(encoding="utf-8"))


def _chain_files(original: Path) -> list[Path]:
    """``original`` and its ``extends`` bases, child first (already checked by ``load_recipe``)."""
    files, path = [], original
    while path is not None and len(files) < 16:
        files.append(path)
        base = (_rt_load(path) or {}).get(EXTENDS_KEY)
        path = (path.parent / base).resolve() if isinstance(base, str) and base else None
    return files


def _inherited(files: list[Path], parts: list[str]) -> Any:
    """A deep copy of the list at ``parts`` from the child-most file of ``files`` that sets it (None: none does)."""
    for file in files:
        node = _rt_load(file)
        for part in parts:
            node = node.get(part) if hasattr(node, "get") else None
            if node is None:
                break
        if isinstance(node, list):
            return copy.deepcopy(node)
    return None


def _put(doc: Any, parts: list[str], value: Any, files: list[Path]) -> None:
    """Set ``parts`` to ``value`` in ``doc`` as the loader's override would (mappings merge, lists replace); a
    list the path goes through is copied whole from the file that sets it."""
    from ruamel.yaml.comments import CommentedMap

    node = doc
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[int(part)]
            continue
        nxt = node.get(part)
        if not isinstance(nxt, (dict, list)):
            nxt = _inherited(files, parts[:i + 1]) if parts[i + 1].isdigit() else CommentedMap()
            if nxt is None:
                raise V4LaunchError(f"cannot write the override of {'.'.join(parts)}: no file of the chain sets the "
                                    f"list {'.'.join(parts[:i + 1])}",
                                    hint="override the whole list instead, e.g. "
                                         f"{'.'.join(parts[:i + 1])}='[...]'")
            node[part] = nxt
        node = nxt
    last = parts[-1]
    key: Any = int(last) if isinstance(node, list) else last
    old = node[key] if isinstance(node, list) else node.get(key)
    if isinstance(old, dict) and isinstance(value, dict):
        for k, v in value.items():
            _put(old, [str(k)], v, [])
    else:
        node[key] = value


def _lookup(data: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return data


def _changes(original: Path, overrides: list[tuple[str, Any]]) -> tuple[tuple[str, Any, Any, str], ...]:
    """(key, value before, value now, where it was set before) of each override, the last of a repeated key."""
    sources = SourceMap()
    before = _chain(original, sources)
    out = []
    for key, value in dict(overrides).items():
        old, where = _lookup(before, key.split(".")), sources.lookup(key)
        if where == "default" or old != value:  # an override that repeats the recipe's value changes nothing
            out.append((key, old, value, where))
    return tuple(out)


def _show(value: Any) -> str:
    text = str(as_written(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _header(original: Path, changes: tuple[tuple[str, Any, Any, str], ...], command: str) -> str:
    lines = [f"{original.stem} with {len(changes)} change{'s' * (len(changes) != 1)}, written by `{command}`"]
    for key, old, new, where in changes:
        before = f"{_show(old)} (set at {where})" if where != "default" else "the default"
        lines.append(f"  {key}: {_show(new)}, was {before}")
    return "\n".join(lines)


def _extends_path(original: Path, folder: Path) -> str:
    """``original`` relative to ``folder`` when they share a folder below the root, else absolute."""
    if os.path.commonpath([original, folder.resolve()]) == original.anchor:
        return original.as_posix()
    return Path(os.path.relpath(original, folder.resolve())).as_posix()


def _parse(overrides: list[str]) -> list[tuple[str, Any]]:
    """(key, value) of each ``key=value`` (already applied by ``load_recipe``, so well formed)."""
    out = []
    for text in overrides:
        key, _, raw = text.partition("=")
        out.append((key.strip(), compose(raw, lines=False)[0] if raw.strip() else None))
    return out


def check_target(target: Path, force: bool) -> None:
    """Raises UsageError: ``target`` is a directory, sits in a missing folder, or exists without ``force``."""
    if target.is_dir():
        raise UsageError(f"--write {display_path(target)}: that is a directory", hint="name a .yaml file to write")
    if not target.parent.is_dir():
        raise UsageError(f"--write {display_path(target)}: the folder {display_path(target.parent)} does not exist",
                         hint="create it first, or write into an existing folder")
    if target.exists() and not force:
        raise UsageError(f"--write {display_path(target)}: the file exists; nothing was written",
                         hint="pass --force to replace it (naming the recipe itself edits it in place, comments "
                              "kept), or write to another file")


def write_overrides(loaded: LoadedRecipe, target: str | Path, *, force: bool = False,
                    command: str = "") -> WrittenRecipe:
    """Write ``loaded``'s overrides as a recipe at ``target`` that loads back to ``loaded.recipe`` exactly.

    Args:
        loaded: the recipe as loaded with its overrides (``loaded.overrides``, in order; already valid YAML).
        target: the file to write. The recipe's own file (with ``force``) is edited in place; any other
            file becomes ``extends: <original, relative to target>`` plus the overridden fields.
        force: replace an existing ``target``.
        command: the command line, quoted in the new file's header comment.

    Raises:
        UsageError: no overrides to write; ``target`` exists without ``force``, is a directory or sits in a
            missing folder.
        V4LaunchError: the written file would not load back to the same recipe (nothing is left at ``target``).
    """
    if not loaded.overrides:
        raise UsageError("--write: no overrides given, so the new recipe would equal the original",
                         hint=f"add the edits to write, e.g. `v4launch validate {display_path(loaded.path)} "
                              "cluster.nodes=8 --write NEW.yaml`")
    target = Path(target).absolute()
    check_target(target, force)
    original = loaded.path.resolve()
    in_place = target.resolve() == original
    overrides = _parse(list(loaded.overrides))
    files = _chain_files(original)
    changes = _changes(original, overrides)
    if not changes:
        raise UsageError(f"--write: every override repeats {display_path(original)}'s own value; nothing to write",
                         hint=f"the recipe is {display_path(original)} as it is")
    changed = {key for key, *_ in changes}
    overrides = [(key, value) for key, value in overrides if key in changed]
    if in_place:
        doc, extends = _rt_load(original), None
    else:
        from ruamel.yaml.comments import CommentedMap

        extends = _extends_path(original, target.parent)
        doc = CommentedMap()
        doc[EXTENDS_KEY] = extends
        doc.yaml_set_start_comment(_header(original, changes, command or _command(loaded, target)))
    for key, value in overrides:
        _put(doc, key.split("."), value, files)
    _replace_checked(doc, target, loaded)
    return WrittenRecipe(target, extends, changes)


def _command(loaded: LoadedRecipe, target: Path) -> str:
    words = ["v4launch", "validate", display_path(loaded.path), *loaded.overrides, "--write", display_path(target)]
    return " ".join(shlex.quote(w) for w in words)


def _replace_checked(doc: Any, target: Path, loaded: LoadedRecipe) -> None:
    """Dump ``doc`` next to ``target``, load it back, and move it over ``target`` only when it resolves to
    ``loaded.resolved``.

    Raises:
        V4LaunchError: it resolves to another recipe (the fields that differ are named).
    """
    buffer = io.StringIO()
    _yaml().dump(doc, buffer)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp.yaml")
    try:
        tmp.write_text(buffer.getvalue(), encoding="utf-8")
        again = load_recipe(tmp).resolved
        if again != loaded.resolved:
            differ = sorted(k for k in set(again) | set(loaded.resolved) if again.get(k) != loaded.resolved.get(k))
            raise V4LaunchError(f"--write: the file written would load as another recipe (sections {', '.join(differ)} "
                                "differ); nothing was written",
                                hint="report this with the command line; meanwhile pass the overrides on the command line")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
