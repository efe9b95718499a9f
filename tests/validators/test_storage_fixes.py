"""Fixes around storage and host offload are whole: applied as printed, the recipe validates.

The report's fix of V4-MEMORY when host memory is the limit (the search may turn the offload off), and the fixes of
V4-CUDA-GRAPH and V4-OFFLOAD-RECOMPUTE on a recipe that trips both: each alternative alone passes both rules.
"""

from __future__ import annotations

import shlex

import pytest

from validate_helpers import RECIPES, invoke

FIX_COMMANDS = "fix: run "


def _commands(text: str, rule: str) -> list[list[str]]:
    """The argument lists of every ``v4launch validate`` command printed as ``rule``'s fix (first occurrence)."""
    line = next(ln for ln in text.splitlines() if f"→ {rule}: {FIX_COMMANDS}" in ln)
    quoted = line.split(FIX_COMMANDS, 1)[1].split("`")[1::2]
    return [shlex.split(c)[2:] for c in quoted]  # without "v4launch validate"


def _validate(args: list[str]) -> tuple[int, str]:
    code, out, err, exc = invoke(["validate", *args])
    assert exc is None, exc
    return code, out + err


def test_a_host_memory_limit_gets_a_whole_fix():
    """flash_4n with selective recompute and 200 GiB of host RAM per node: offload cannot stay (546 GiB a node at
    1M); the fix found turns it off on more nodes, and pasted it validates."""
    args = [str(RECIPES / "flash_4n.yaml"), "parallel.recompute_granularity=selective",
            "parallel.recompute_modules=[moe_act]", "cluster.host_memory_gib=200"]
    code, text = _validate(args)
    assert code == 1
    (fix,) = _commands(text, "V4-MEMORY")
    assert "parallel.cpu_offloading=false" in fix and "cluster.host_memory_gib=200" in fix
    assert _validate(fix)[0] == 0


@pytest.mark.parametrize("rule", ["V4-CUDA-GRAPH", "V4-OFFLOAD-RECOMPUTE"])
def test_graph_and_offload_fixes_each_pass_both_rules(rule):
    args = [str(RECIPES / "bench_h200.yaml"), "compile.cuda_graph=true", "parallel.cpu_offloading=true"]
    code, text = _validate(args)
    assert code == 1 and "V4-CUDA-GRAPH" in text and "V4-OFFLOAD-RECOMPUTE" in text
    commands = _commands(text, rule)
    assert len(commands) == 2
    for fix in commands:
        code, after = _validate(fix)
        assert code == 0, (fix, [ln for ln in after.splitlines() if ln.startswith("fail")])
