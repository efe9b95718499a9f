"""The validate reports and dry runs the docs show are the ones `v4launch` prints today.

Each ``$ v4launch validate …`` line inside a code block of README.md, docs/validate.md or docs/time-plan.md is run
as written (from a folder holding a copy of ``recipes/``, so the paths read as shown and the workspace it records
is the test's; 200 columns, as the examples were captured) and every line of its shown output must be a line of
the real output. A ``$ v4launch submit … --dry-run`` line runs after the doc's last validate example before it
(the recipe that validate recorded in the workspace is the one it submits).
Lines holding an ellipsis (``…`` or ``...``) are elisions and are skipped, as are examples of a recipe the
repository does not ship (docs/validate.md's ``typo.yaml``). A figure that changes in the memory or time plan
then fails here until the docs show it (the README's Flash report had gone stale: warm-up activations 3.4 GiB
shown, 8.9 printed).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/validate.md", "docs/time-plan.md")


def _examples() -> list[tuple[str, int, str, list[str], str | None]]:
    """(doc, line number, command, shown output lines, the validate command run first or None) of each one-line
    validate example and each submit dry run in a code block."""
    out = []
    for doc in DOCS:
        lines = (REPO / doc).read_text().split("\n")
        in_code, last_validate = False, None
        for i, line in enumerate(lines):
            if line.startswith("```"):
                in_code = not in_code
                continue
            command = line[2:].split("  #")[0].strip()
            validate = line.startswith("$ v4launch validate ")
            dry_run = line.startswith("$ v4launch submit ") and "--dry-run" in command.split()
            if not (in_code and (validate or dry_run)) or line.rstrip().endswith("\\"):
                continue
            shown = []
            for after in lines[i + 1:]:
                if after.startswith(("```", "$ ")):
                    break
                shown.append(after)
            out.append((doc, i + 1, command, shown, None if validate else last_validate))
            if validate:
                last_validate = command
    return out


EXAMPLES = _examples()


def test_the_docs_have_examples_to_check():
    assert {doc for doc, *_ in EXAMPLES} == set(DOCS)
    assert len(EXAMPLES) >= 8, EXAMPLES
    assert any(first for *_, first in EXAMPLES), "no submit dry run found"


def _v4launch(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v4launch", *shlex.split(command)[1:]], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"}, timeout=120)


@pytest.mark.parametrize("doc,line,command,shown,first", EXAMPLES, ids=[f"{d}:{n}" for d, n, *_ in EXAMPLES])
def test_a_shown_report_is_what_validate_prints(doc, line, command, shown, first, tmp_path):
    args = shlex.split(first or command)[1:]
    if len(args) < 2 or not args[1].endswith(".yaml"):
        pytest.skip(f"{doc}:{line} validates the workspace's recipe: nothing to run from a clean folder")
    if not (REPO / args[1]).exists():
        pytest.skip(f"{doc}:{line} shows a recipe the repository does not ship ({args[1]})")
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")  # the paths as shown; the workspace state lands here
    if first:
        assert _v4launch(first, tmp_path).returncode == 0, f"{doc}:{line}: `{first}` (run first) failed"
    done = _v4launch(command, tmp_path)
    printed = {row.rstrip() for row in (done.stdout + done.stderr).split("\n")}
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    stale = [row for row in shown if row.strip() and "…" not in row and "..." not in row
             and row.rstrip() not in printed]
    assert not stale, f"{doc}:{line} `{command}` shows lines it no longer prints:\n" + "\n".join(stale)
