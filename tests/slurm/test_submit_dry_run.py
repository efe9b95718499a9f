"""`v4launch submit --dry-run`: every stage's job (nodes, time limit, what queues it, resume point), the rendered
sbatch scripts and the frozen recipe written into a folder a person can read, and `--json`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import slurm_helpers

from v4launch.recipe_loading import load_recipe

REPO = Path(__file__).resolve().parents[2]
FLASH_4N = str(REPO / "recipes" / "flash_4n.yaml")
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return slurm_helpers.cli(*args, cwd=cwd, columns=400)


def test_dry_run_shows_every_stage_job_and_writes_their_scripts(ws: Path):
    out = cli("submit", FLASH_4N, "--dry-run", cwd=ws)
    assert out.returncode == 0, out.stderr
    (folder,) = (ws / ".v4launch" / "dry-run").iterdir()
    assert f"written: {folder} (" in out.stdout and not (ws / "runs").exists()
    assert "6 Slurm job(s), one per stage, each on 4 node(s) x 8 GPU(s)" in out.stdout
    stages = ["dense_64k", "warmup_64k", "sparse_64k", "sparse_128k", "sparse_256k", "sparse_1m"]
    rows = [line for line in out.stdout.splitlines() if line[:1].isdigit()]
    assert [row.split()[1] for row in rows] == stages
    assert "this submit" in rows[0] and all(f"stage {i}'s end" in rows[i + 1] for i in range(5))
    scripts = sorted(folder.glob("*.sbatch"))
    assert [p.name for p in scripts] == [f"stage{i}-{name}.sbatch" for i, name in enumerate(stages)]
    for script in scripts:
        lines = script.read_text().splitlines()
        assert "#SBATCH --nodes=4" in lines and "#SBATCH --time=240" in lines and "#SBATCH --ntasks-per-node=8" in lines
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    chain = json.loads((folder / "chain.json").read_text())
    jobs = chain["jobs"]
    assert [j["first_step"] for j in jobs[1:]] == [j["first_step"] + j["steps"] for j in jobs[:-1]]
    assert jobs[0]["resume"] == "a fresh initialisation (step 0)"
    assert jobs[3]["resume"] == f"stage 2 sparse_64k's last checkpoint (global step {jobs[3]['first_step']})"
    assert jobs[3]["cp"] == 8 and jobs[5]["cp"] == 32 and all(j["time_limit_min"] == 240 for j in jobs)
    assert all(j["est_wall_h"] > 0 and j["est_segments"] >= 1 for j in jobs)
    assert load_recipe(folder / "recipe.yaml").resolved == load_recipe(FLASH_4N).resolved
    assert "_submitted.pkl" in (folder / "AT_SUBMIT.txt").read_text()


def test_dry_run_json_and_its_folder(ws: Path):
    out = cli("submit", TINY, "--nodes", "1", "--dry-run-dir", "job", "--json", cwd=ws)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert Path(payload["dry_run_dir"]) == (ws / "job").resolve()
    assert len(payload["jobs"]) == len(load_recipe(TINY).recipe.curriculum.stages)
    assert payload["jobs"][0]["nodes"] == 1 and payload["jobs"][0]["est_wall_h"] is None  # a CPU target: no estimate
    assert payload["jobs"][1]["dependency"] == "queued by stage 0's job when that stage completes"
    assert sorted(p.name for p in (ws / "job").glob("*.sbatch")) == [j["script"] for j in payload["jobs"]]
    assert not (ws / "runs").exists()


def test_dry_run_dir_holding_other_files_is_refused(ws: Path):
    (ws / "mine").mkdir()
    (ws / "mine" / "notes.txt").write_text("keep me")
    out = cli("submit", TINY, "--dry-run-dir", "mine", cwd=ws)
    assert out.returncode == 2 and "holds other files (notes.txt)" in " ".join(out.stderr.split())
    assert [p.name for p in (ws / "mine").iterdir()] == ["notes.txt"]
