"""`v4launch submit --dry-run`, refusals, and status / logs / cancel without a cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from v4launch.errors import RefusedError
from v4launch.slurm.submit import check_clean, code_revision

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")
V4LAUNCH = str(Path(sys.executable).with_name("v4launch"))


def cli(*args, cwd, path=None):
    env = dict(os.environ, COLUMNS="160")
    if path is not None:
        env["PATH"] = path
    return subprocess.run([V4LAUNCH, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def ws(tmp_path):
    (tmp_path / ".v4launch").mkdir()
    return tmp_path


def dry_script(ws: Path) -> str:
    """The first stage's sbatch script of the newest dry run in workspace ``ws``."""
    folders = sorted((ws / ".v4launch" / "dry-run").iterdir(), key=lambda p: p.stat().st_mtime)
    return next(iter(sorted(folders[-1].glob("stage0-*.sbatch")))).read_text()


def test_dry_run_prints_the_exact_script_and_submits_nothing(ws):
    out = cli("submit", TINY, "--nodes", "2", "slurm.partition=gpu nodes", "slurm.time_min=30", "--dry-run",
              "parallel.global_batch_size=8", "curriculum.stages.2.global_batch_size=8", cwd=ws)
    assert out.returncode == 0, out.stderr
    script = dry_script(ws)
    assert script.startswith("#!/bin/bash\n") and "dry run: nothing submitted" in out.stderr
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition='gpu nodes'",
                 "#SBATCH --time=30", "#SBATCH --signal=USR2@120", "#SBATCH --open-mode=append"):
        assert line in script.splitlines(), line
    assert "--gpus-per-node" not in script and "submitit.core._submit" in script
    assert not (ws / "runs").exists()
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_submit_refuses_a_layout_the_job_cannot_run_before_anything_is_queued(ws):
    """ep 4 over the 2 ranks of a pipeline rank: refused at submit with the rule and the fix, nothing queued."""
    out = cli("submit", str(REPO / "recipes" / "flash_debug.yaml"), "--nodes", "1", "parallel.ep=4", "--dry-run", cwd=ws)
    assert out.returncode == 1, out.stdout
    assert "V4-EP-FOLD" in out.stderr and "set parallel.ep=2 (the largest ep up to 4" in " ".join(out.stderr.split())
    assert "Traceback" not in out.stderr and not out.stdout and not (ws / "runs").exists()


def test_submit_defaults_to_the_workspace_recipe(ws):
    from v4launch.workspace import Workspace

    Workspace(ws).remember(recipe=TINY)
    out = cli("submit", "slurm.qos=high", "--dry-run", cwd=ws)
    assert out.returncode == 0, out.stderr
    assert f"recipe: {TINY} (the workspace's recipe)" in " ".join(out.stderr.split())
    assert "#SBATCH --qos=high" in dry_script(ws)


def test_submit_takes_a_shipped_recipe_by_name_as_validate_does(ws):
    from v4launch.workspace import Workspace

    out = cli("submit", "tiny_cpu", "--nodes", "1", "--dry-run", cwd=ws)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=1" in dry_script(ws)
    assert out.stdout and not (ws / "runs").exists()
    assert Workspace(ws).state().get("recipe") is None  # a dry run records nothing


def test_nodes_flag_and_a_pasted_cluster_nodes_edit_that_disagree_are_refused(ws):
    """A V4-MEMORY fix pasted after `--nodes 4` says cluster.nodes=8: the flag used to win silently."""
    out = cli("submit", TINY, "--nodes", "4", "cluster.nodes=8", "--dry-run", cwd=ws)
    assert out.returncode == 2 and not out.stdout
    text = " ".join(out.stderr.split())
    assert "--nodes 4 and the override cluster.nodes=8 disagree" in text and "drop --nodes" in text
    assert "Traceback" not in out.stderr and not (ws / "runs").exists()
    same = cli("submit", TINY, "--nodes", "1", "cluster.nodes=1", "--dry-run", cwd=ws)
    assert same.returncode == 0, same.stderr
    pasted = cli("submit", TINY, "cluster.nodes=4", "cluster.nodes=1", "--nodes", "1", "--dry-run", cwd=ws)
    assert pasted.returncode == 0, pasted.stderr  # the override that applies (the last) agrees with --nodes


def test_contract_violation_refuses_with_rule_ids(ws):
    out = cli("submit", TINY, "parallel.cp=3", "--nodes", "2", "--dry-run", cwd=ws)
    assert out.returncode == 1
    assert "V4-WORLD-SIZE" in out.stderr and "Traceback" not in out.stderr
    assert not (ws / "runs").exists()
    # one line per violation, naming every stage it occurs in (the labels are not eaten as markup)
    assert "V4-WORLD-SIZE [stages dense_512, warmup_512] cluster.gpus_per_node=2" in " ".join(out.stderr.split())
    # the hint reproduces the refusal: same recipe, same overrides, --nodes included
    hint = " ".join(out.stderr.split())
    assert f"v4launch validate {TINY} parallel.cp=3 cluster.nodes=2" in hint, hint
    again = subprocess.run([V4LAUNCH, "validate", TINY, "parallel.cp=3", "cluster.nodes=2"], cwd=ws,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "V4-WORLD-SIZE" in again.stdout + again.stderr


def test_unknown_sbatch_parameter_lists_the_valid_ones(ws):
    out = cli("submit", TINY, "slurm.additional_parameters.mail_usr=me", "--dry-run", cwd=ws)
    assert out.returncode == 2
    text = " ".join(out.stderr.split())
    assert "mail_usr" in text and "mail-user" in text and "Traceback" not in text


def test_newline_in_a_value_is_refused(ws, tmp_path):
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"extends: {TINY}\n" + 'slurm: {account: "acct\\n#SBATCH --uid=0"}\n')
    out = cli("submit", str(recipe), "--dry-run", cwd=ws)
    assert out.returncode == 2 and "control characters" in " ".join(out.stderr.split())


def test_without_slurm_submit_fails_clearly_and_leaves_no_run(ws):
    out = cli("submit", TINY, "--allow-dirty", cwd=ws, path="/nonexistent")
    assert out.returncode == 1, out.stderr
    assert "srun" in out.stderr and "dev-cluster up" in " ".join(out.stderr.split())
    assert not list((ws / "runs").glob("*/run.json"))


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_dirty_tree_is_refused_unless_allowed(tmp_path):
    repo = tmp_path / "src"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    clean = code_revision(repo)
    assert clean.sha and not clean.dirty
    check_clean(clean, allow_dirty=False)
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")
    dirty = code_revision(repo)
    assert dirty.dirty and dirty.untracked == ("new.py",) and "+x = 2" in dirty.diff
    with pytest.raises(RefusedError, match="uncommitted") as err:
        check_clean(dirty, allow_dirty=False)
    assert "--allow-dirty" in err.value.hint
    check_clean(dirty, allow_dirty=True)


def test_status_logs_cancel_on_a_local_run(ws, monkeypatch):
    from v4launch.rundir import create_run_dir
    from v4launch.training.recipe_io import load_recipe

    monkeypatch.chdir(ws)
    run_dir = create_run_dir(load_recipe(TINY), "local")
    status = cli("status", cwd=ws)
    assert status.returncode == 0 and "not launched" in status.stdout and "(local)" in status.stdout
    assert cli("logs", str(run_dir), cwd=ws).returncode == 0
    cancel = cli("cancel", run_dir.name, cwd=ws)
    assert cancel.returncode == 1 and "not running" in cancel.stderr and "v4launch resume" in cancel.stderr
    from v4launch.launcher_base import record_launch

    record_launch(run_dir, state="completed")  # a finished run: nothing to resume either, so no resume hint
    done = cli("cancel", run_dir.name, cwd=ws)
    text = " ".join(done.stderr.split())
    assert done.returncode == 1 and "(state: completed): nothing to cancel" in text and "resume" not in text


def test_status_without_runs_is_a_usage_error(ws):
    out = cli("status", cwd=ws)
    assert out.returncode == 2 and "no run" in out.stderr and "Traceback" not in out.stderr


def test_status_loss_cell_names_its_step_when_it_is_not_the_rows():
    """The loss column is the last logged step's; a run stopped between log steps showed step 19 beside step
    10's loss with nothing saying so."""
    from v4launch.cli.status import _loss_cell

    assert _loss_cell(4.11372, 19, 10) == "4.114 (step 10)"
    assert _loss_cell(4.11372, 10, 10) == "4.114"
    assert _loss_cell(None, 19, 10) == "-" and _loss_cell(2.5, 3, None) == "2.500"


def test_the_promised_first_commands_validate_flash_4n_then_submit_it_on_4_nodes(ws):
    """README's `v4launch validate recipes/flash_4n.yaml` then `v4launch submit --nodes 4` (the workspace's
    recipe): V4-Flash on 4 x 8 H200 passes the contract, and the dry run renders its 4-node job."""
    flash_4n = str(REPO / "recipes" / "flash_4n.yaml")
    out = cli("validate", flash_4n, cwd=ws)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "V4-MEMORY" in out.stdout and "fail " not in out.stdout
    out = cli("submit", "--nodes", "4", "--dry-run", cwd=ws)
    assert out.returncode == 0, out.stderr
    assert f"recipe: {flash_4n}" in " ".join(out.stderr.split())
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in dry_script(ws).splitlines(), line
    assert not (ws / "runs").exists()
