"""Document sources: the Python standard library's own sources, or user text / JSONL files.

A document is one ``str``. Iterators are deterministic (sorted paths) so the
prepared dataset, and its cache key, only change when the inputs change.
"""

from __future__ import annotations

import io
import json
import sys
import sysconfig
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import UsageError

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Directory names never entered (third-party packages, bytecode)."""


class DataError(UsageError):
    """A data input that cannot be read: missing file, bad JSONL line, missing key (exit 2)."""


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files under the stdlib, skipping ``SKIP_DIRS`` and hidden directories."""
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).parts
        if any(part in SKIP_DIRS or part.startswith(".") for part in rel[:-1]):
            continue
        if p.is_file():
            out.append(p)
    return sorted(out)


def _decode_source(data: bytes) -> str | None:
    """Python source bytes → text honouring the PEP 263 coding cookie; None for binary (NUL bytes)."""
    if b"\x00" in data:
        return None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:  # a deliberately broken cookie in the stdlib's test data
        encoding = "utf-8"
    try:
        return data.decode(encoding, errors="replace")
    except LookupError:  # unknown codec named in the cookie
        return data.decode("utf-8", errors="replace")


def python_stdlib_documents(root: Path | None = None) -> Iterator[str]:
    """One document per standard-library ``.py`` file of the running interpreter, in sorted path order.

    Files with NUL bytes (binary test data) are skipped; undecodable bytes become
    U+FFFD after honouring the file's coding cookie. Python 3.11 ships about 2,000
    such files, ~35 MB of text.
    """
    for path in stdlib_files(root):
        try:
            text = _decode_source(path.read_bytes())
        except OSError:
            continue  # unreadable file in a system directory: not the user's input, skip it
        if text is not None:
            yield text


def _expand(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file()
                              and not any(part.startswith(".") for part in f.relative_to(p).parts)))
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"data.paths: {p} does not exist", hint="fix the path in the recipe's data.paths (relative paths resolve against the working directory)")
    return out


def input_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files ``file_documents`` reads: given files as-is, directories recursively (sorted, hidden skipped).

    Raises:
        DataError: a path does not exist.
    """
    return _expand(paths)


def _jsonl_documents(path: Path, key: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not a JSON object ({e})", hint="each line of a .jsonl file must be one JSON object") from e
            if not isinstance(record, dict) or key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{lineno}: no key {key!r} (found {keys})", hint="set data.jsonl_key to the field holding the text")
            text = record[key]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: {key!r} holds {type(text).__name__}, not text")
            yield text


def _text_document(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {e.start}: {e.reason})",
                        hint="convert the file to UTF-8 or remove it from data.paths") from e


def file_documents(paths: Iterable[str | Path], jsonl_key: str = "text") -> Iterator[str]:
    """Documents from files: ``.jsonl`` → one per line (field ``jsonl_key``); any other file → one document.

    Directories are read recursively in sorted order. Text must be UTF-8.

    Raises:
        DataError: missing path, unreadable file, invalid JSON line, missing or non-text key,
            non-UTF-8 text; the message names the file and line.
    """
    for path in _expand(paths):
        try:
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, jsonl_key)
            else:
                yield _text_document(path)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror or e})") from e


def documents_for(source: str, paths: Iterable[str | Path] = (), jsonl_key: str = "text") -> Iterator[str]:
    """The iterator ``data.source`` names (``python_stdlib`` or ``files``).

    Raises:
        DataError: ``files`` without paths, or an unknown source.
    """
    if source == "python_stdlib":
        return python_stdlib_documents()
    if source == "files":
        paths = list(paths)
        if not paths:
            raise DataError("data.source=files but data.paths is empty", hint="list text/.jsonl files or directories in data.paths")
        return file_documents(paths, jsonl_key)
    raise DataError(f"data.source={source!r}: unknown source", hint="use python_stdlib or files")


def interpreter_id() -> str:
    """Python version + stdlib path: part of the python_stdlib cache key."""
    return f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}:{stdlib_root()}"
