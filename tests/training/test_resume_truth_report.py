"""Resume tells the whole truth (issue 21): a field-level report, data overrides that are really
applied (never a worker traceback), one recipe hash everywhere, and `resume --max-steps / --no-progress`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from train_helpers import train_records

from v4launch.checkpoints import Manifest, latest_checkpoint

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> tuple[int, str, str]:
    """``v4launch ARGS`` in-process: (exit code, stdout, stdout + stderr + the error's message and hint)."""
    from typer.testing import CliRunner

    from v4launch.cli import app
    from v4launch.errors import V4LaunchError

    result = CliRunner().invoke(app, [str(a) for a in args])
    text = result.output
    if isinstance(result.exception, V4LaunchError):
        return result.exception.exit_code, result.stdout, text + result.exception.message + "\n" + (result.exception.hint or "")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, text


@pytest.fixture
def cli_run(workspace, write_recipe):
    """A local run made by `v4launch run RECIPE --max-steps 3` (stopped at the dense stage's end)."""
    code, _, text = cli("run", write_recipe(), "--max-steps", "3", "--no-progress")
    assert code == 0, text
    (run,) = (workspace / "runs").iterdir()
    assert latest_checkpoint(run / "checkpoints").name == "step_00000003"
    return run


def items(stdout: str) -> dict[str, dict]:
    """The report items of `resume --json` by aspect."""
    return {i["aspect"]: i for i in json.loads(stdout)["items"]}


def events(run: Path, name: str) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("kind") == "event" and r.get("event") == name]


def test_new_data_seed_is_reported_applied_then_trained_and_later_resumes_work(cli_run):
    run = cli_run
    recipe_before = (run / "recipe.yaml").read_text()
    code, out, text = cli("resume", run, "data.seed=7", "--dry-run", "--json")
    assert code == 0, text
    seed = items(out)["data.seed"]
    assert seed["verdict"] == "applied" and "1234 → 7" in seed["reason"] and "data order changes" in seed["reason"]
    assert (run / "recipe.yaml").read_text() == recipe_before and not (run / "resume.json").exists()
    # the real resume trains with the new order (no worker traceback), with the progress flags of `run`
    code, _, text = cli("resume", run, "data.seed=7", "--max-steps", "5", "--no-progress")
    assert code == 0, text
    assert latest_checkpoint(run / "checkpoints").name == "step_00000005"
    (note,) = [e for e in events(run, "data")]
    assert note["step"] == 3
    assert "seed: 7" in (run / "recipe.yaml").read_text()
    # every later plain resume works: the checkpoint at 5 was saved over the seed-7 data
    code, out, text = cli("resume", run, "--json", "--dry-run")
    assert code == 0 and "data.seed" not in items(out), text
    code, _, text = cli("resume", run, "--no-progress")
    assert code == 0, text
    assert sorted(train_records(run)) == list(range(1, 9))


def test_new_seed_rebuilds_the_loader_as_a_fresh_pass_in_the_new_order(cli_run):
    """The rebuilt state, loaded into the job's loader, yields exactly what a brand-new loader with
    data.seed=7 yields (an independent reference), and the global micro-batch count carries on."""
    from v4launch.data import PackedBatchLoader, PreparedDataset
    from v4launch.data.resume_state import loader_state_for_resume
    from v4launch.rundir import load_run
    from v4launch.training.recipe_io import load_recipe

    run = cli_run
    manifest = Manifest.read(latest_checkpoint(run / "checkpoints"))
    ds = PreparedDataset.read(Path(json.loads((run / "run.json").read_text())["extra"]["data_prefix"]))
    old = PackedBatchLoader(ds.train_prefix, seq_len=64, seed=1234, dp_rank=0, dp_size=1)
    for _ in range(5):
        next(old)
    saved = old.state_dict()
    same, note = loader_state_for_resume(saved, manifest=manifest, recipe=load_run(run).recipe, dataset=ds, run_dir=run)
    assert same is saved and note is None
    seven = load_recipe(run / "recipe.yaml", ["data.seed=7"]).recipe
    fresh, note = loader_state_for_resume(saved, manifest=manifest, recipe=seven, dataset=ds, run_dir=run)
    assert "data.seed 1234 → 7" in note and fresh["micro_batches_consumed"] == 5
    got = PackedBatchLoader(ds.train_prefix, seq_len=64, seed=7, dp_rank=0, dp_size=1)
    got.load_state_dict(fresh)
    ref = PackedBatchLoader(ds.train_prefix, seq_len=64, seed=7, dp_rank=0, dp_size=1)
    for _ in range(4):
        a, b = next(got), next(ref)
        assert a.segments == b.segments and a.tokens.equal(b.tokens)
    # the same data: section but other data (inputs changed under the run): refused, named, no traceback
    from v4launch.data import DataError

    with pytest.raises(DataError, match="differ from checkpoint step 3"):
        loader_state_for_resume({**saved, "num_docs": saved["num_docs"] + 1}, manifest=manifest,
                                recipe=load_run(run).recipe, dataset=ds, run_dir=run)


def test_document_cap_is_applied_to_the_data_the_job_reads(cli_run):
    run = cli_run
    code, out, text = cli("resume", run, "data.max_documents=6", "--dry-run", "--json")
    assert code == 0, text
    cap = items(out)["data.max_documents"]
    assert cap["verdict"] == "applied" and "null → 6" in cap["reason"] and "prepared again" in cap["reason"]
    code, _, text = cli("resume", run, "data.max_documents=6", "--max-steps", "4", "--no-progress")
    assert code == 0, text
    prefix = json.loads((run / "run.json").read_text())["extra"]["data_prefix"]
    from v4launch.data import PreparedDataset

    ds = PreparedDataset.read(Path(prefix))
    assert ds.num_documents + ds.num_valid_documents == 6  # 6 documents taken, one held out (fraction 0.2)
    (note,) = events(run, "data")
    assert note["step"] == 3
    log = (run / "logs" / "rank0.log").read_text()
    assert f"fresh pass over {ds.num_documents} documents" in log and "data.max_documents null → 6" in log


def test_new_packing_continues_the_same_data_without_preparing_again(cli_run):
    """data.packing only changes how rows are filled: the loader continues from its saved position over the
    same prepared dataset (no fresh pass, no data event), and the report says so."""
    run = cli_run
    prefix_before = json.loads((run / "run.json").read_text())["extra"]["data_prefix"]
    code, out, text = cli("resume", run, "data.packing=fill_rows", "--dry-run", "--json")
    assert code == 0, text
    packing = items(out)["data.packing"]
    assert packing["verdict"] == "applied" and "whole_documents → fill_rows" in packing["reason"]
    assert "not prepared again" in packing["reason"] and "nothing is skipped or repeated" in packing["reason"]
    code, _, text = cli("resume", run, "data.packing=fill_rows", "--max-steps", "5", "--no-progress")
    assert code == 0, text
    assert json.loads((run / "run.json").read_text())["extra"]["data_prefix"] == prefix_before
    assert events(run, "data") == [] and "packing: fill_rows" in (run / "recipe.yaml").read_text()
    assert sorted(train_records(run)) == [1, 2, 3, 4, 5]
    # the job's loaders: training fills rows, evaluation packs whole documents
    from types import SimpleNamespace

    from v4launch.data import PreparedDataset
    from v4launch.rundir import load_run
    from v4launch.training.data_io import stage_loader

    ds = PreparedDataset.read(Path(prefix_before))
    plan, layout = SimpleNamespace(seq_len=64, micro_batch=1), SimpleNamespace(dp_rank=0, dp=1)
    recipe = load_run(run).recipe
    assert stage_loader(ds, recipe, plan, layout).fill_rows
    assert not stage_loader(ds, recipe, plan, layout, valid=True).fill_rows


def test_report_lists_every_changed_field_with_its_verdict(cli_run):
    run = cli_run
    code, out, text = cli("resume", run, "--json", "--dry-run", "optimizer.lr=1e-3", "logging.interval_steps=2",
                          "curriculum.stages.0.seq_len=32", "curriculum.stages.2.seq_len=64", "run.output_root=elsewhere",
                          "slurm.time_min=5", "model.compress_ratios=[0,128,4,0]", "cluster.gpus_per_node=2")
    assert code == 1, text
    got = {k: (v["verdict"], v["override"]) for k, v in items(out).items()}
    assert got["optimizer.lr"] == ("applied", None)
    assert got["logging.interval_steps"] == ("safe", None)
    assert got["curriculum.stages.2.seq_len"] == ("applied", None)
    assert got["curriculum.stages.0.seq_len"] == ("refused", None)  # a finished stage: would never run
    assert got["run.output_root"] == ("refused", None)             # the run directory does not move
    assert got["slurm.time_min"] == ("refused", None)              # a local run never reads slurm:
    assert got["model.compress_ratios"] == ("refused", "--allow-layer-change")
    assert got["cluster.gpus_per_node"] == ("reshard", None)
    recipe_item = items(out)["recipe"]["reason"]
    assert "8 field(s)" in recipe_item
    assert "3 → 3.0e-3" not in text and "0.003 → 0.001" in items(out)["optimizer.lr"]["reason"]
    assert not (run / "resume.json").exists()


def test_one_recipe_hash_in_run_json_manifests_file_names_and_report(cli_run):
    from v4launch.rundir import recipe_on_record

    run = cli_run
    first = json.loads((run / "run.json").read_text())["recipe_hash"]
    assert Manifest.read(run / "checkpoints" / "step_00000003").recipe_hash == first
    code, out, text = cli("resume", run, "optimizer.lr=1e-3", "--max-steps", "4", "--no-progress")
    assert code == 0, text
    second = json.loads((run / "run.json").read_text())["recipe_hash"]
    assert Manifest.read(run / "checkpoints" / "step_00000004").recipe_hash == second != first
    kept = run / f"recipe.{first[:12]}.yaml"
    assert kept.is_file() and recipe_on_record(run, first)["optimizer"]["lr"] == 3.0e-3
    assert f"{first[:12]} → {second[:12]}" in " ".join(text.split())


def test_local_run_records_the_source_revision_and_dirty_state(cli_run):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip())
    extra = json.loads((cli_run / "run.json").read_text())["extra"]
    assert head and extra["git_sha"] == head and extra["code"]["git_sha"] == head
    assert extra["code"]["dirty"] == dirty and (cli_run / "code.diff").exists() == dirty
