"""One ``fix all:`` line for a recipe failing several rules (v4launch/cli/combined_fix.py; issue 41).

Each rule's own line fixes that rule only, so a documented variant failing two rules (README.md's flash_8n at PP4:
V4-PP-BALANCE and V4-WORLD-SIZE) had no line that passes. ``validate`` now merges the rules' fixes, validates the
merge, and prints it only when it passes. The first test takes every ``$ v4launch validate`` example with
overrides from README.md and docs/*.md, and pastes the combined line each prints, as printed.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from validate_helpers import REPO, RECIPES, invoke
from v4launch.cli import combined_fix

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _documented_variants() -> list[list[str]]:
    """The words after ``v4launch validate`` of each ``$ v4launch validate RECIPE OVERRIDE …`` example in the docs
    (a line ending in ``\\`` continues on the next), recipe paths relative to the repository."""
    found: list[list[str]] = []
    for doc in DOCS:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())
        for line in re.findall(r"^\$ v4launch validate (.+)$", text, flags=re.M):
            words = shlex.split(line.split("  #")[0])
            if len(words) > 1 and words[0].endswith(".yaml") and words not in found:
                found.append(words)
    return found


VARIANTS = _documented_variants()


def _combined_line(out: str) -> str | None:
    """The command of the report's ``fix all: run `…``` line, or None when it prints none."""
    lines = [line for line in out.splitlines() if "fix all: run `" in line]
    assert len(lines) <= 1, lines
    return lines[0].split("fix all: run `", 1)[1].split("`", 1)[0] if lines else None


def _paste(command: str) -> tuple[int, str]:
    words = shlex.split(command)
    assert words[:2] == ["v4launch", "validate"], command
    code, out, err, exc = invoke(words[1:])
    assert exc is None, exc
    return code, out + err


def test_the_docs_examples_failing_several_rules_are_found():
    """The extraction finds README's two failing examples and docs/validate.md's fused-kernel one."""
    wanted = [["recipes/flash_8n.yaml", "parallel.pp=4", "parallel.pp_layout=Et*10|t*11|t*11|t*11mL", "parallel.ep=16"],
              ["recipes/flash_4n.yaml", "parallel.pp=4", "parallel.pp_layout=Et*10|t*12|t*12|t*9mL", "parallel.ep=8",
               "precision.params_dtype=fp32", "parallel.cpu_offloading=false"],
              ["recipes/flash_8n.yaml", "curriculum.stages.1.kernel_backend=triton", "parallel.pp=4", "parallel.ep=16",
               "parallel.pp_layout=Et*10|t*11|t*11|t*11mL"]]
    for words in wanted:
        assert words in VARIANTS, words


@pytest.mark.parametrize("words", VARIANTS, ids=lambda w: " ".join(w)[:90])
def test_a_documented_variant_failing_several_rules_prints_one_line_that_passes(words: list[str], in_tmp: Path):
    args = ["validate", str(REPO / words[0]), *words[1:], "-q"]
    code, out, _, exc = invoke(args)
    assert exc is None
    if code != 1:  # the docs' exit-2 examples (an unknown key, a bad value) and the passing ones
        assert _combined_line(out) is None
        return
    rules = {m for m in re.findall(r"→ (V4-[A-Z0-9-]+): fix: run `", out)}
    command = _combined_line(out)
    if len(rules) < 2:
        assert command is None and "fix all:" not in out
        return
    assert command is not None, out[-3000:]
    (line,) = [x for x in out.splitlines() if "fix all: run `" in x]
    assert line.endswith(")") and f"`{command}` (passes: " in line
    code, pasted = _paste(command)
    assert code == 0, (command, pasted[-2000:])


def test_a_memory_fix_that_clears_another_rule_is_printed_alone(in_tmp: Path):
    """Seed 004's 4-node shape fails V4-MEMORY and V4-WORLD-SIZE; the memory fix (PP1 × EP32 on the 4 nodes) passes
    alone, so the combined line leaves out V4-WORLD-SIZE's 16 nodes."""
    args = ["validate", str(RECIPES / "flash_4n.yaml"), "parallel.pp=4", "parallel.pp_layout=Et*10|t*12|t*12|t*9mL",
            "parallel.ep=8", "precision.params_dtype=fp32", "parallel.cpu_offloading=false", "--json"]
    code, out, _, _ = invoke(args)
    data = json.loads(out)
    assert code == 1 and {v["rule_id"] for v in data["violations"]} == {"V4-MEMORY", "V4-WORLD-SIZE"}
    fix = data["combined_fix"]
    assert fix["found"] and fix["rules"] == ["V4-MEMORY"] and "V4-WORLD-SIZE then passes" in fix["note"]
    assert not any(e.startswith("cluster.nodes=") for e in fix["edits"]) and "parallel.pp=1" in fix["edits"]


def test_a_backend_fix_that_makes_the_memory_fix_needless_is_printed_alone(in_tmp: Path):
    """flash_4n on cudnn fails V4-KERNEL-AVAILABLE, V4-SM90-DENSE-LOSS and V4-MEMORY (whose search, for the recipe
    as it stands, moves it to 8 nodes); triton alone fits it on its 4. The combined line was reference + 8 nodes
    (reference was the kernel fix's first alternative, and the memory fix was never pruned)."""
    args = ["validate", str(RECIPES / "flash_4n.yaml"), "attention.kernel_backend=cudnn", "--json"]
    code, out, _, _ = invoke(args)
    data = json.loads(out)
    assert code == 1 and {"V4-KERNEL-AVAILABLE", "V4-MEMORY"} <= {v["rule_id"] for v in data["violations"]}
    fix = data["combined_fix"]
    assert fix["found"] and fix["edits"] == ["attention.kernel_backend=triton"], fix
    assert fix["rules"] == ["V4-KERNEL-AVAILABLE"] and "V4-MEMORY then pass" in fix["note"].replace("V4-SM90-DENSE-LOSS, ", "")
    assert _paste(fix["command"])[0] == 0


def test_json_carries_the_combined_fix_and_the_line_pastes(base_file: Path, in_tmp: Path):
    bad = ["parallel.global_batch_size=6", "parallel.pp_layout=Et|t*7mL"]  # V4-BATCH and V4-PP-BALANCE
    code, out, _, _ = invoke(["validate", str(base_file), *bad, "--json"])
    fix = json.loads(out)["combined_fix"]
    assert code == 1 and fix["found"] and set(fix["rules"]) == {"V4-BATCH", "V4-PP-BALANCE"}
    assert fix["still_failing"] == [] and fix["command"].startswith(f"v4launch validate {base_file} ")
    assert "parallel.pp_layout=Et|t*7mL" not in fix["command"]  # the user's layout, which the fix sets again
    code, out, _, _ = invoke(["validate", str(base_file), *bad])
    assert _combined_line(out) == fix["command"]
    assert _paste(fix["command"])[0] == 0


def test_no_combined_fix_says_which_rule_still_fails(base_file: Path, in_tmp: Path):
    """V4-OGROUPS' fix is in words: merging the other two rules' fixes cannot pass, and the report says so."""
    bad = ["model.o_groups=3", "parallel.global_batch_size=6", "parallel.pp_layout=Et|t*7mL"]
    code, out, _, _ = invoke(["validate", str(base_file), *bad, "-q"])
    assert code == 1 and _combined_line(out) is None
    (line,) = [x for x in out.splitlines() if "fix all:" in x]
    assert "no combined fix found" in line and "V4-OGROUPS still fails" in line
    data = json.loads(invoke(["validate", str(base_file), *bad, "--json"])[1])["combined_fix"]
    assert not data["found"] and data["command"] is None and data["still_failing"] == ["V4-OGROUPS"]


@pytest.mark.parametrize("bad", [[], ["parallel.global_batch_size=6"], ["model.o_groups=3", "cluster.gpus_per_node=7"]])
def test_no_search_with_fewer_than_two_rules_with_edits(bad: list[str], base_file: Path, in_tmp: Path,
                                                        monkeypatch: pytest.MonkeyPatch):
    """Clean, one failing rule, or one rule with edits beside one in words: nothing is validated again."""
    def refuse(*_args):
        raise AssertionError("the combined search ran")

    monkeypatch.setattr(combined_fix, "_validate", refuse)
    code, out, _, exc = invoke(["validate", str(base_file), *bad, "--json"])
    assert exc is None and code == (0 if not bad else 1)
    assert json.loads(out)["combined_fix"] is None
    code, out, _, exc = invoke(["validate", str(base_file), *bad, "-q"])
    assert exc is None and "fix all:" not in out


def test_a_cp_that_splits_neither_the_world_nor_seq_len_is_fixed_by_the_nearest_cp(in_tmp: Path):
    """cp=3 on flash_4n's 32 GPUs: V4-WORLD-SIZE and V4-CP-DIVISIBLE each offer the nearest cp that fits first
    (4: divides 32 and 65,536; 2 is as near, the larger wins), their other ways (12 nodes; seq_len 65,538) after;
    the combined line is cp=4 alone and passes. It was 12 nodes with seq_len 65,538 and larger batches."""
    args = ["validate", str(RECIPES / "flash_4n.yaml"), "parallel.cp=3", "--json"]
    code, out, _, _ = invoke(args)
    data = json.loads(out)
    fixes = {v["rule_id"]: v["fix"] for v in data["violations"] if v["stage"] == "dense_64k"}
    assert fixes["V4-WORLD-SIZE"].startswith("set parallel.cp=4 (") and ", or cluster.nodes=12" in fixes["V4-WORLD-SIZE"]
    assert fixes["V4-CP-DIVISIBLE"].startswith("set parallel.cp=4 (") and "seq_len=65538" in fixes["V4-CP-DIVISIBLE"]
    fix = data["combined_fix"]
    assert fix["found"] and fix["edits"] == ["parallel.cp=4"], fix
    assert _paste(fix["command"])[0] == 0
