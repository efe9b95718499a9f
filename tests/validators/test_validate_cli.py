"""`v4launch validate` / `v4launch explain`: exit codes, report content, JSON, workspace default recipe."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from validate_helpers import FLASH_4N_SEED_004, RECIPES, invoke, write_recipe
from v4launch.validators import RULES
from v4launch.workspace import Workspace
from validator_fixtures import base


HUGE_GPU = "cluster.gpu_memory_gib=1048576"
"""The variants of flash_4n below (another cp, reference kernels) need not fit an H200 (V4-MEMORY,
docs/memory-plan.md); with a 1 PiB budget the rest of its contract is what these tests see."""


def test_clean_recipe_exits_0_and_prints_every_rule(in_tmp: Path):
    code, out, err, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), HUGE_GPU])
    assert exc is None and code == 0, err
    assert "OK: 0 violations" in out
    for stage in ("dense_64k", "warmup_64k", "sparse_64k", "sparse_128k", "sparse_256k", "sparse_1m"):
        assert f"stage" in out and stage in out
    for rule_id in RULES:
        assert rule_id in out
    assert "n/a" in out and "pass" in out
    assert "320.0 MiB" in out  # CSA all-gather per layer at 1M (2**20) tokens
    assert "memory plan" in out and "1048576.0" in out
    assert Workspace.current(in_tmp).state()["recipe"] == str((RECIPES / "flash_4n.yaml").resolve())


def test_violation_exits_1_with_field_source_and_fix(in_tmp: Path):
    path = write_recipe(in_tmp, base())
    code, out, _, exc = invoke(["validate", str(path), "parallel.cp_partition=zigzag"])
    assert exc is None and code == 1
    assert "V4-CP-CONTIGUOUS" in out and "parallel.cp_partition = zigzag" in out
    assert "override parallel.cp_partition=zigzag" in out and "fix:" in out and "FAIL: 1 violation" in out


def test_a_whole_recipe_fix_is_printed_once_and_referred_to_under_later_stages(in_tmp: Path):
    """pro_16n fails V4-MEMORY in all six stages with one whole-recipe fix (32 nodes with bf16 storage): printed in
    full under the first stage, referred to under the others (it was printed six times)."""
    code, out, _, exc = invoke(["validate", str(RECIPES / "pro_16n.yaml")])
    assert exc is None and code == 1
    arrows = [line for line in out.splitlines() if line.startswith("  → V4-MEMORY")]
    assert len(arrows) == 6, arrows
    assert arrows[0].startswith("  → V4-MEMORY: fix: run `v4launch validate ")
    assert "cluster.nodes=32" in arrows[0] and "precision.params_dtype=bf16" in arrows[0]
    assert all(line.endswith("fix: the same as under stage 0 dense_64k (above)") for line in arrows[1:]), arrows
    assert out.count("cluster.nodes=32 parallel.pp=2 parallel.ep=128") == 1


def test_a_fix_is_one_unwrapped_line_and_per_stage_figures_follow_a_reference(in_tmp: Path):
    """A fix is pasted into a shell: it must not be broken across lines at the console width (the whole fix of
    flash_4n in seed 004's shape is a ~400-character command). The same edits with this stage's own figures refer
    to the first."""
    flash_4n = str(RECIPES / "flash_4n.yaml")
    _, out, _, _ = invoke(["validate", flash_4n, *FLASH_4N_SEED_004])
    (line,) = [x for x in out.splitlines() if x.startswith("  → V4-MEMORY: fix: run `")]
    assert line.startswith(f"  → V4-MEMORY: fix: run `v4launch validate {flash_4n} ") and len(line) > 400
    assert "precision.params_dtype=bf16" in line and "curriculum.stages.5.cp=32" in line
    assert line.endswith("and no other rule fails)")
    flash_8n = str(RECIPES / "flash_8n.yaml")
    _, out, _, _ = invoke(["validate", flash_8n, "parallel.recompute_granularity=none"])
    arrows = [x for x in out.splitlines() if x.startswith("  → V4-MEMORY")]
    assert arrows[0].startswith(f"  → V4-MEMORY: fix: run `v4launch validate {flash_8n} "
                                "parallel.recompute_granularity=full 'parallel.recompute_modules=[]'`")
    later = [x for x in arrows[1:] if "the same edits as under stage 0 dense_64k (above) (" in x]
    assert later and all(x.rstrip().endswith("GiB)") for x in later), arrows


def test_piped_report_lines_carry_no_trailing_blanks(in_tmp: Path):
    """Off a terminal the console is 200 columns wide (no folding at 80); rich padded every table row to it,
    so a report redirected to a file was mostly blanks. Lines now end at their last character."""
    _, out, _, _ = invoke(["validate", str(RECIPES / "flash_8n.yaml")])
    lines = out.splitlines()
    assert len(lines) > 40 and any(line.startswith("pass    V4-TP-ONE") for line in lines)
    assert not [line for line in lines if line.endswith(" ")], [line for line in lines if line.endswith(" ")][:3]


def test_an_override_given_twice_is_said_with_the_value_that_applies(in_tmp: Path):
    """``optimizer.lr=2e-4 … optimizer.lr=3e-3``: the last applies (omegaconf's dotlist order), which was silent."""
    from v4launch.recipe_loading import load_recipe
    from v4launch.training.recipe_io import check_recipe

    args = ["optimizer.lr=2e-4", "optimizer.min_lr=1e-5", "optimizer.lr=3e-3"]
    code, out, err, exc = invoke(["validate", str(RECIPES / "tiny_cpu.yaml"), *args])
    assert exc is None and code == 0, err
    line = "optimizer.lr is given 2 times (2e-4, then 3e-3): the last, 3e-3, applies"
    assert line in " ".join(err.split())
    loaded = load_recipe(RECIPES / "tiny_cpu.yaml", args)
    assert loaded.recipe.optimizer.lr == 3e-3 and line in check_recipe(loaded)  # run / submit / resume print it
    assert load_recipe(RECIPES / "tiny_cpu.yaml", args[:2]).repeated_overrides() == []


def test_a_piped_error_is_one_line_per_line_of_its_message(in_tmp: Path):
    """Off a terminal rich hard-wrapped errors at the 200-column pipe width, leaving a blank-padded first line
    and the rest (here the override that set the field) on a line of its own."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-m", "v4launch", "validate", str(RECIPES / "tiny_cpu.yaml"),
                           "optimizer.lr=1e-9"], cwd=in_tmp, capture_output=True, text=True, timeout=60, env=env)
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(line) > 200, proc.stderr
    assert line.endswith("(optimizer.lr: override optimizer.lr=1e-9)") and " \n" not in proc.stderr, proc.stderr


def test_warning_only_exits_0(in_tmp: Path):
    path = write_recipe(in_tmp, base())
    code, out, _, _ = invoke(["validate", str(path), "curriculum.stages.1.phase=sparse"])
    assert code == 0 and "warn" in out and "V4-PHASE-SKIP-WARMUP" in out and "1 warning" in out


def test_json_report(in_tmp: Path):
    code, out, _, _ = invoke(["validate", str(RECIPES / "flash_4n.yaml"), HUGE_GPU, "parallel.cp=8", "--json"])
    data = json.loads(out)  # the 64K stages now run CP with the fused kernels: accepted (they have a CP path)
    assert code == 0 and data["violations"] == []
    code, out, _, _ = invoke(["validate", str(RECIPES / "flash_4n.yaml"), HUGE_GPU, "parallel.cp=8", "parallel.cp_partition=zigzag",
                              "--json"])
    data = json.loads(out)
    assert code == 1 and {v["rule_id"] for v in data["violations"]} == {"V4-CP-CONTIGUOUS"}
    code, out, _, _ = invoke(["validate", str(RECIPES / "flash_4n.yaml"), HUGE_GPU, "parallel.cp=8",
                              "attention.kernel_backend=reference", "--json"])
    data = json.loads(out)
    assert code == 0 and data["ok"] is True and data["recipe"] == "flash_4n"
    assert [s["derived"]["cp"] for s in data["stages"]][:3] == [8, 8, 8]
    memory = data["stages"][0]["derived"]["memory"]
    assert memory["fits"] and memory["total_bytes"] == sum(t["bytes"] for t in memory["terms"])
    first = data["stages"][0]["results"][0]
    assert set(first) >= {"rule_id", "status", "field", "value", "source", "note", "violations"}
    code, out, _, _ = invoke(["validate", str(write_recipe(in_tmp, base())), "parallel.tp=2", "--json"])
    data = json.loads(out)
    assert code == 1 and data["ok"] is False and data["violations"][0]["rule_id"] == "V4-TP-ONE"
    assert data["violations"][0]["source"] == "override parallel.tp=2"


def test_unreadable_recipe_exits_2(in_tmp: Path):
    code, _, err, exc = invoke(["validate", str(in_tmp / "missing.yaml")])
    assert exc is None and code == 2 and "recipe not found" in err
    bad = in_tmp / "bad.yaml"
    bad.write_text("name: x\nparallel: {cpp: 2}\ncurriculum: {stages: [{name: a, seq_len: 8, steps: 1}]}\n")
    code, out, err, _ = invoke(["validate", str(bad), "--json"])
    assert code == 2 and "did you mean 'parallel.cp'" in err and json.loads(out)["ok"] is False


def test_bad_override_exits_2(in_tmp: Path):
    code, _, err, _ = invoke(["validate", str(write_recipe(in_tmp, base())), "parallel.cp"])
    assert code == 2 and "bad override 'parallel.cp'" in err


def test_default_recipe_from_workspace(in_tmp: Path, monkeypatch):
    code, _, err, _ = invoke(["validate"])
    assert code == 2 and "no recipe given" in err
    path = write_recipe(in_tmp, base())
    assert invoke(["validate", str(path)])[0] == 0
    code, out, err, _ = invoke(["validate"])  # the recipe under the working directory: shown as typed there
    assert code == 0 and f"recipe: {path.name} (the workspace's recorded recipe)" in " ".join(err.split())
    (in_tmp / "sub").mkdir()
    monkeypatch.chdir(in_tmp / "sub")  # the same workspace from a folder below it: the recipe is not under it
    code, out, err, _ = invoke(["validate"])
    assert code == 0 and f"recipe: {path.resolve()} (the workspace's recorded recipe)" in " ".join(err.split())
    monkeypatch.chdir(in_tmp)
    # a first positional with '=' that is not a file is an override, not the recipe
    code, out, err, _ = invoke(["validate", "parallel.tp=2"])
    assert code == 1 and "V4-TP-ONE" in out and "the workspace's recorded recipe" in err
    # the recipe after an override: said, not read as a malformed override of the workspace's recipe
    for command in ("validate", "run", "submit"):
        code, out, err, _ = invoke([command, "parallel.tp=2", str(path)])
        flat = " ".join(err.split())
        assert code == 2 and "the recipe is the first argument" in flat and f"v4launch {command} {path}" in flat
        assert "recorded recipe" not in err


def test_file_with_equals_in_its_name_is_a_recipe(in_tmp: Path):
    path = write_recipe(in_tmp, base(), "a=b.yaml")
    code, _, _, _ = invoke(["validate", path.name])
    assert code == 0


def test_explain(in_tmp: Path):
    code, out, _, _ = invoke(["explain", "V4-CP-BOUNDARY"])
    rule = RULES["V4-CP-BOUNDARY"]
    assert code == 0 and rule.statement[:40] in " ".join(out.split()) and "cp_utils.py" in out and "fix:" in out
    assert invoke(["explain", "cp-boundary"])[0] == 0
    code, out, err, _ = invoke(["explain", "V4-CP-BOUNDRY"])
    assert code == 2 and "did you mean V4-CP-BOUNDARY" in err and "V4-TP-ONE" not in out
    code, out, err, _ = invoke(["explain", "QQQQ-ZZZZ"])  # nothing close: the list of rules, on stderr (it failed)
    assert code == 2 and "unknown rule id" in err and "V4-TP-ONE" in err and not out.strip()
    assert err.lstrip().startswith("no rule 'QQQQ-ZZZZ'")  # said before the long list, not only after it
    code, out, err, _ = invoke(["explain", "V4-NOPE"])  # the shared "V4-" made V4-RECOMPUTE look close
    assert code == 2 and "did you mean" not in err and "V4-TP-ONE" in err and not out.strip()
    assert "did you mean V4-RECOMPUTE?" in invoke(["explain", "recomput"])[2]
    code, out, _, _ = invoke(["explain", "v4"])  # the prefix every id shares: every rule
    assert code == 0 and all(rid in out for rid in RULES)
    code, out, _, _ = invoke(["explain", "V4-PP"])  # a family prefix: its rules, not every rule
    pp = [r for r in RULES if r.startswith("V4-PP-")]
    assert code == 0 and len(pp) > 2 and all(r in out for r in pp) and "V4-TP-ONE" not in out
    assert [r["id"] for r in json.loads(invoke(["explain", "cp", "--json"])[1])] == \
        [r for r in RULES if r.startswith("V4-CP-")]
    assert invoke(["explain", "v4_memory"])[0] == 0 and invoke(["explain", "pp_balance"])[0] == 0
    code, out, _, _ = invoke(["explain"])
    assert code == 0 and all(rid in out for rid in RULES)
    code, out, _, _ = invoke(["explain", "V4-TP-ONE", "--json"])
    assert json.loads(out)["source"].startswith("Megatron")
    code, out, err, _ = invoke(["explain", " "])  # an empty id: its own error, not the whole rule table
    assert code == 2 and "rule id is empty" in err and "V4-TP-ONE" not in err + out


def test_explain_wraps_a_long_value_under_itself():
    """A value longer than the line (V4-MEMORY's fields) continues in its own column, not under the labels."""
    code, out, _, _ = invoke(["explain", "V4-MEMORY"])
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  fields:"))
    column = lines[start].index("cluster.")
    tail = lines[start + 1:next(i for i, line in enumerate(lines) if line.startswith("  fix:"))]
    assert tail and all(line[:column].strip() == "" and line[column:].strip() for line in tail), lines
    assert " ".join(" ".join(lines[start:start + 1 + len(tail)]).split()).count("curriculum.stages.*.cp") == 1


def test_explain_prints_fixes_and_sources_whole():
    """A fix holding a YAML list is printed as written (not read as console markup), and a Source: paragraph
    over several docstring lines is kept whole."""
    code, out, _, _ = invoke(["explain", "V4-RECOMPUTE"])
    flat = " ".join(out.split())
    assert code == 0 and "parallel.recompute_modules=[mla_up_proj]" in flat
    assert "model/parallel/recompute.py" in flat  # the source's second line
    code, out, _, _ = invoke(["explain", "V4-RECOMPUTE-REPLAY", "--json"])
    assert json.loads(out)["source"].endswith("``replayed_collectives``.")
    for rule in RULES.values():
        assert rule.source.count("(") == rule.source.count(")"), (rule.id, rule.source)


def test_validate_into_a_closed_pipe_exits_with_its_verdict(tmp_path: Path):
    """`v4launch validate … | head -1`: the reader has left; the exit code is still 0 for a clean recipe and 1
    for a violation, without a traceback (rich alone exits 1 for both). The pipe's read end is closed before
    the command writes, so every write meets a broken pipe."""
    import os

    for name, over, want in (("flash_4n.yaml", [], 0), ("flash_4n.yaml", list(FLASH_4N_SEED_004), 1)):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            proc = subprocess.run([sys.executable, "-m", "v4launch", "validate", str(RECIPES / name), *over],
                                  cwd=tmp_path, stdout=write_end, stderr=subprocess.PIPE, timeout=60)
        finally:
            os.close(write_end)
        err = proc.stderr.decode()
        assert proc.returncode == want and "Traceback" not in err and "Exception" not in err, (name, over, err)


def test_an_error_into_a_closed_pipe_keeps_its_exit_code(tmp_path: Path):
    """`v4launch validate … parallel.ppp=1 2>&1 | head -1`: stdout and stderr both go to a pipe whose reader has
    left; a usage error still exits 2 (rich alone exits 1 on stderr's broken pipe), without a traceback."""
    import os

    for args in (["validate", str(RECIPES / "tiny_cpu.yaml"), "parallel.ppp=1"], ["explain", "V4-NOPE"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            proc = subprocess.run([sys.executable, "-m", "v4launch", *args], cwd=tmp_path, stdout=write_end,
                                  stderr=write_end, timeout=60)
        finally:
            os.close(write_end)
        assert proc.returncode == 2, (args, proc.returncode)


def test_help_has_examples():
    code, out, _, _ = invoke(["validate", "--help"])
    assert code == 0 and "validate recipes/flash_4n.yaml" in out and "Exit 0" in " ".join(out.split())


def test_python_dash_m_runs_the_same_cli(in_tmp: Path):
    run = subprocess.run([sys.executable, "-m", "v4launch", "--version"], capture_output=True, text=True, cwd=in_tmp)
    assert run.returncode == 0 and run.stdout.startswith("v4launch "), run.stderr


def test_version_and_non_mapping_recipes(in_tmp: Path):
    code, out, _, _ = invoke(["--version"])
    assert code == 0 and out.startswith("v4launch ")
    (in_tmp / "empty.yaml").write_text("")
    code, _, err, _ = invoke(["validate", str(in_tmp / "empty.yaml")])
    assert code == 2 and "got an empty file" in err
    (in_tmp / "list.yaml").write_text("[1, 2]\n")
    code, _, err, _ = invoke(["validate", str(in_tmp / "list.yaml")])
    assert code == 2 and "got a list ([1, 2])" in err


def test_missing_run_directory_says_what_is_missing(in_tmp: Path):
    (in_tmp / "runs" / "tiny-1").mkdir(parents=True)
    (in_tmp / "runs" / "tiny-1" / "run.json").write_text("{}")
    code, _, err, _ = invoke(["status", "runs/nope"])
    assert code == 2 and "not a run directory (no such directory)" in err and "tiny-1" in err
    (in_tmp / "runs" / "empty").mkdir()
    code, _, err, _ = invoke(["status", "runs/empty"])
    assert code == 2 and "(it has no run.json)" in err


def test_set_at_names_the_override_that_caused_a_finding_on_another_field(in_tmp: Path):
    """--nodes 3 makes DP 6: the EP fold and batch findings sit on parallel.ep / the global batch, whose
    recipe lines did not change; "set at" must also name the override that broke them."""
    code, out, _, _ = invoke(["validate", str(RECIPES / "flash_4n.yaml"), "cluster.nodes=3", "--json"])
    data = json.loads(out)
    found = {v["rule_id"]: v for v in data["violations"]}
    assert code == 1 and {"V4-EP-FOLD", "V4-BATCH"} <= set(found)
    for rule_id in ("V4-EP-FOLD", "V4-BATCH"):
        own, *extra = found[rule_id]["source"].split("; ")
        assert re.fullmatch(r".+\.yaml:\d+", own), own
        assert extra == ["override cluster.nodes=3"], found[rule_id]["source"]
    # a finding on the overridden field itself names it once
    code, out, _, _ = invoke(["validate", str(RECIPES / "flash_4n.yaml"), "parallel.ep=7", "--json"])
    v = next(v for v in json.loads(out)["violations"] if v["rule_id"] == "V4-EP-EXPERTS")
    assert v["source"] == "override parallel.ep=7"


def test_checkpoint_import_of_a_missing_directory_is_a_usage_error_said_first(in_tmp: Path):
    """A mistyped released-checkpoint path: exit 2 (a usage error, as every other wrong path), and said before
    any line about which recipe would have been used."""
    code, out, err, _ = invoke(["checkpoint", "import", str(in_tmp / "nope")])
    assert code == 2 and "no such directory" in err and "recipe" not in out + err.split("hint:")[0]


def test_the_time_plan_of_a_failing_recipe_says_it_prices_the_recipe_as_given(in_tmp):
    """`parallel.ep=7` on flash_4n fails the EP rules, and the time plan was printed for ep=7 with nothing saying
    the layout is invalid; its note now names the failing rules. A passing recipe's note does not."""
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), "parallel.ep=7"])
    assert exc is None and code == 1
    note = " ".join(out.split("time plan", 1)[1].split())
    assert "the recipe fails V4-EP-EXPERTS, V4-EP-FOLD" in note and "as given, not as a fix would make it" in note
    code, out, _, _ = invoke(["validate", str(RECIPES / "flash_4n.yaml")])
    assert code == 0 and "as given, not as a fix" not in out
