"""`v4launch validate RECIPE OVERRIDES` then `v4launch submit --dry-run`: the workspace's recipe with the same
overrides, said on one line; overrides given to submit replace them; a recipe named to submit runs as written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import slurm_helpers

REPO = Path(__file__).resolve().parents[2]
FLASH_4N = str(REPO / "recipes" / "flash_4n.yaml")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return slurm_helpers.cli(*args, cwd=cwd, columns=400)


def script_lines(ws: Path) -> list[str]:
    """The first stage's sbatch script of the newest dry run in ``ws``, as lines."""
    folders = sorted((ws / ".v4launch" / "dry-run").iterdir(), key=lambda p: p.stat().st_mtime)
    return next(iter(sorted(folders[-1].glob("stage0-*.sbatch")))).read_text().splitlines()


def test_submit_reuses_the_overrides_validate_passed_and_says_so(ws: Path):
    assert cli("validate", FLASH_4N, "cluster.nodes=8", cwd=ws).returncode == 0
    out = cli("submit", "--dry-run", cwd=ws)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=8" in script_lines(ws)
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("recipe: ")]
    assert line == (f"recipe: {FLASH_4N} (the workspace's recipe) with the overrides it was last validated with "
                    "(passed): cluster.nodes=8")


def test_overrides_given_to_submit_replace_the_remembered_ones(ws: Path):
    assert cli("validate", FLASH_4N, "cluster.nodes=8", cwd=ws).returncode == 0
    out = cli("submit", "slurm.time_min=60", "--dry-run", cwd=ws)
    assert out.returncode == 0, out.stderr
    lines = script_lines(ws)
    assert "#SBATCH --nodes=4" in lines and "#SBATCH --time=60" in lines
    assert ("with slurm.time_min=60, given here: they replace the overrides it was last validated with "
            "(cluster.nodes=8)") in out.stderr


def test_a_recipe_named_to_submit_runs_as_written_and_the_cli_says_the_overrides_are_not_applied(ws: Path):
    assert cli("validate", FLASH_4N, "cluster.nodes=8", cwd=ws).returncode == 0
    out = cli("submit", FLASH_4N, "--dry-run", cwd=ws)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=4" in script_lines(ws)
    assert "(cluster.nodes=8) are not applied to a recipe named here" in out.stderr


def test_the_written_fix_submits(ws: Path):
    """validate's --write, then submit NEW.yaml: the fixed recipe renders its 8-node job."""
    out = cli("validate", FLASH_4N, "cluster.nodes=8", "--write", "f8.yaml", cwd=ws)
    assert out.returncode == 0 and (ws / "f8.yaml").is_file(), out.stderr
    out = cli("submit", "f8.yaml", "--dry-run", cwd=ws)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=8" in script_lines(ws)


def test_a_remembered_node_count_against_nodes_says_where_it_came_from(ws: Path):
    """--nodes against a cluster.nodes the workspace remembers (not typed on this command): the hint says so and
    how to submit either way; typed on the command, the hint asks to give the count once."""
    assert cli("validate", FLASH_4N, "cluster.nodes=8", cwd=ws).returncode == 0
    remembered = cli("submit", "--nodes", "4", "--dry-run", cwd=ws)
    assert remembered.returncode == 2 and "disagree" in remembered.stderr
    assert "the workspace remembers from the last `v4launch validate`" in remembered.stderr
    assert f"`v4launch submit {FLASH_4N} --nodes 4`" in remembered.stderr
    typed = cli("submit", FLASH_4N, "cluster.nodes=8", "--nodes", "4", "--dry-run", cwd=ws)
    assert typed.returncode == 2 and "give the node count once" in typed.stderr
