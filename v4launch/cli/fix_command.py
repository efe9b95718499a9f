"""A rule's fix as a command line that can be pasted as it is.

Rules write a fix as ``set k=v k2=v2 (what it gives)``, or alternatives ``set k=v (…), or k3=v3 (…)``
(``validators/memory_fixes.py``: each edit already one shell word). The report prints each ``set`` clause as
``v4launch validate RECIPE OVERRIDES k=v k2=v2``: the recipe as the user named it and the overrides they
gave, less those the fix sets again, so the pasted line validates the fixed recipe. A fix that is prose
(``remove 'qkv_linear' from …``) is printed unchanged.
"""

from __future__ import annotations

import re
import shlex

_EDIT = re.compile(r"[A-Za-z_][\w]*(?:\.[\w*]+)+=.*", re.S)
"""One dotlist edit ``section.key=value`` (after the shell has removed any quotes)."""


_TAIL = re.compile(r" \(|; ")
"""Where a clause's edits end: its note in parentheses or a sentence after a semicolon."""


def _split_tail(clause: str) -> list[str]:
    """``k=v (note)`` -> [``k=v``, `` (``, ``note)``]; ``k=v; text`` -> [``k=v``, ``; ``, ``text``]; no tail:
    [clause, "", ""]."""
    m = _TAIL.search(clause)
    return [clause[:m.start()], m.group(0), clause[m.end():]] if m else [clause, "", ""]


def _edits(words: str) -> list[str] | None:
    """The edits of ``words`` (``k=v 'k2=a|b'``), or None when any word is not an edit."""
    try:
        parts = shlex.split(words)
    except ValueError:
        return None
    return parts if parts and all(_EDIT.fullmatch(p) for p in parts) else None


def kept_overrides(overrides: list[str], edits: list[str]) -> list[str]:
    """The user's ``overrides`` less those whose key one of ``edits`` sets again (the edits then come after)."""
    keys = {e.split("=", 1)[0] for e in edits}
    return [o for o in overrides if o.split("=", 1)[0] not in keys]


def command_line(recipe: str, overrides: list[str], edits: list[str]) -> str:
    """``v4launch validate RECIPE KEPT EDITS`` with each word shell-quoted (``kept_overrides``: KEPT)."""
    return " ".join(shlex.quote(w) for w in ["v4launch", "validate", recipe, *kept_overrides(overrides, edits),
                                             *edits])


def alternatives(fix: str) -> list[list[str]]:
    """The edits of each ``, or`` alternative of a ``set`` fix, in the rule's order; [] when the fix is prose
    (``pasteable`` prints it unchanged)."""
    if not fix.startswith("set "):
        return []
    out = [_edits(_split_tail(clause)[0]) for clause in fix[4:].split(", or ")]
    return [] if any(e is None for e in out) else out  # type: ignore[misc]


def pasteable(fix: str, recipe: str, overrides: list[str]) -> str:
    """``fix`` with each ``set`` clause of edits turned into a ``v4launch validate`` command line.

    Args:
        fix: the rule's fix text. recipe: the recipe path as the user gave it. overrides: their dotlist
            overrides (``k=v`` strings), in order.
    Returns: the text to print; unchanged when it holds no ``set`` clause made only of edits.
    """
    if not fix.startswith("set "):
        return fix
    out = []
    for clause in fix[4:].split(", or "):
        words, sep, rest = _split_tail(clause)
        edits = _edits(words)
        if edits is None:
            return fix
        out.append(f"`{command_line(recipe, overrides, edits)}`" + (sep + rest if sep else ""))
    return "run " + ", or ".join(out)
