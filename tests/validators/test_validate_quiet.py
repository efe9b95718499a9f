"""`v4launch validate --quiet` (-q, --failures): failing and warning findings only, each once with its stages."""

from __future__ import annotations

from pathlib import Path

from validate_helpers import RECIPES, invoke

FLASH_4N = str(RECIPES / "flash_4n.yaml")


def _rows(out: str, rule_id: str) -> list[str]:
    return [line for line in out.splitlines() if line.split()[1:2] == [rule_id]]


def test_quiet_prints_a_finding_repeated_across_stages_once_with_its_stages(in_tmp: Path):
    bad = ["parallel.ep=3", "parallel.global_batch_size=7"]
    code, full, _, exc = invoke(["validate", FLASH_4N, *bad])
    assert exc is None and code == 1
    code, out, _, exc = invoke(["validate", FLASH_4N, *bad, "-q"])
    assert exc is None and code == 1  # the exit code is the verdict, as without -q
    assert len(_rows(full, "V4-EP-FOLD")) == 6
    (row,) = _rows(out, "V4-EP-FOLD")
    assert row.startswith("fail") and "all 6 stages" in row and "parallel.ep = 3" in row
    (batch,) = _rows(out, "V4-BATCH")
    assert "dense_64k, warmup_64k, sparse_64k" in batch
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("  → ")] == \
        ["  → V4-EP-EXPERTS", "  → V4-EP-FOLD", "  → V4-BATCH", "  → V4-RECOMPUTE-REPLAY", "  → fix all"]  # 3 rules
    assert not [line for line in out.splitlines() if line.startswith(("pass", "n/a"))]
    assert "GiB per GPU" not in out and "time plan" not in out and "stage 0 dense_64k" not in out
    assert out.rstrip().splitlines()[-1].startswith("FAIL: 10 violations, 1 warning (exit 1); ")
    assert len(out.splitlines()) < len(full.splitlines()) / 4


def test_quiet_on_a_clean_recipe_prints_the_header_and_the_verdict(in_tmp: Path):
    for flag in ("--quiet", "--failures"):
        code, out, _, exc = invoke(["validate", FLASH_4N, flag])
        assert exc is None and code == 0
        assert "V4-RECOMPUTE-REPLAY" in out and "fail " not in out
        assert "OK: 0 violations, 1 warning (exit 0); " in out and "passing or n/a rows not shown (--quiet)" in out
