"""A process killed during a checkpoint save; resume refusals and overrides through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from train_helpers import losses, train_records

from v4launch.checkpoints import latest_checkpoint
from v4launch.training.job import train

KILL_DURING_SAVE = textwrap.dedent("""
    import os, sys
    import v4launch.checkpoints.dcp as dcp
    real = dcp._write_manifest
    def dying(directory, manifest):
        if manifest.step == 4:          # shards are on disk, manifest and rename are not
            os._exit(9)
        real(directory, manifest)
    dcp._write_manifest = dying
    from v4launch.training.job import train
    train(sys.argv[1], progress=False)
""")


@pytest.mark.slow
def test_killed_during_save_leaves_previous_checkpoint_and_resume_picks_it(new_run):
    ref = new_run()
    train(ref, progress=False)
    run = new_run({"checkpointing": {"interval_steps": 2}})
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(run)], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr[-2000:]
    ckpts = run / "checkpoints"
    assert (ckpts / ".tmp-step_00000004").is_dir()
    assert latest_checkpoint(ckpts).name == "step_00000003"  # stage-end save of the dense stage
    result = train(run, progress=False)
    assert result.status == "completed"
    # steps 4.. were logged by the killed process too; the resumed ones must match the reference
    recs = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "train":
            recs[rec["step"]] = rec  # later lines (the resumed run) win
    assert losses(recs) == losses(train_records(ref))


def _cli(*args: str) -> tuple[int, str]:
    """Run ``v4launch ARGS`` in-process; (exit code, stdout + stderr)."""
    from v4launch.cli import app
    from v4launch.errors import V4LaunchError
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, list(args))
    text = result.output
    if isinstance(result.exception, V4LaunchError):
        return result.exception.exit_code, text + result.exception.message + "\n" + (result.exception.hint or "")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, text


@pytest.fixture
def stopped_run(new_run):
    """A run stopped after its dense stage (checkpoint at step 3, phase dense) and one at warm-up step 4."""
    run = new_run()
    train(run, max_steps=3, progress=False)
    return run


@pytest.mark.parametrize("args, flag", [
    (("model.compress_ratios=[0,128,4,0]",), "--allow-layer-change"),
    (("optimizer.name=adamw",), "--allow-optimizer-regroup"),
    (("--phase", "sparse"), "--allow-cold-indexer"),
])
def test_each_refusal_exits_1_and_names_its_flag_and_the_flag_overrides(stopped_run, args, flag):
    code, text = _cli("resume", str(stopped_run), *args, "--dry-run")
    assert code == 1 and flag in text and "refused" in text
    code, text = _cli("resume", str(stopped_run), *args, flag, "--dry-run")
    assert code == 0, text
    assert "overridden" in text


def test_phase_regression_refused_then_allowed_and_trained(new_run):
    run = new_run()
    train(run, max_steps=4, progress=False)  # checkpoint in warm-up (indexer built)
    code, text = _cli("resume", str(run), "--stage", "dense", "--dry-run")
    assert code == 1 and "--allow-phase-regression" in text
    code, text = _cli("resume", str(run), "--stage", "0", "--allow-phase-regression")
    assert code == 1 and "--allow-optimizer-regroup" in text  # dropping the indexer also drops its groups
    code, text = _cli("resume", str(run), "--stage", "0", "--allow-phase-regression", "--allow-optimizer-regroup")
    assert code == 0, text
    assert latest_checkpoint(run / "checkpoints").name == "step_00000012"  # 4 done, then all 8 steps again
    phases = [r["phase"] for _, r in sorted(train_records(run).items())]
    assert phases == ["dense"] * 3 + ["warmup"] + ["dense"] * 3 + ["warmup"] * 3 + ["sparse"] * 2


def test_tokenizer_change_refused_then_allowed(stopped_run):
    manifest = stopped_run / "checkpoints" / "step_00000003" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["tokenizer"] = "other-tokenizer:v1"
    manifest.write_text(json.dumps(data))
    code, text = _cli("resume", str(stopped_run), "--dry-run")
    assert code == 1 and "--allow-tokenizer-change" in text
    code, text = _cli("resume", str(stopped_run), "--allow-tokenizer-change", "--dry-run")
    assert code == 0
    # the run's bare name under the workspace's runs/ works as for status, logs and cancel
    code, text = _cli("resume", stopped_run.name, "--allow-tokenizer-change", "--dry-run")
    assert code == 0, text
    code, text = _cli("resume", "no-such-run", "--dry-run")
    assert code == 2 and "no-such-run" in text


def test_cold_indexer_override_really_trains_sparse(stopped_run):
    code, text = _cli("resume", str(stopped_run), "--phase", "sparse", "--allow-cold-indexer")
    assert code == 0, text
    recs = train_records(stopped_run)
    assert [recs[s]["phase"] for s in sorted(recs)] == ["dense"] * 3 + ["sparse"] * 2
    assert not (stopped_run / "resume.json").exists() and (stopped_run / "resume.done.json").exists()


def test_resume_refused_while_the_run_is_live_writes_nothing(stopped_run):
    import os

    from v4launch.launcher_base import record_launch
    from v4launch.rundir import RunPaths

    paths = RunPaths(stopped_run)
    recipe_before = paths.recipe.read_text()
    record_launch(stopped_run, state="running", pids=[os.getpid()])  # a live launch of this run
    code, text = _cli("resume", str(stopped_run), "optimizer.lr=1.0e-3")
    assert code == 1 and "already running" in text
    assert not paths.resume.exists(), "a refused resume must not leave a pending request"
    assert paths.recipe.read_text() == recipe_before, "a refused resume must not re-freeze the recipe"


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_saves_and_exits_130_naming_the_resume_command(workspace, write_recipe, signame):
    """A real SIGINT (Ctrl-C) or SIGTERM (`kill`) to `v4launch run`: the workers finish the step and
    save a checkpoint, the exit code is 130 (not 0: the curriculum did not end), the message says how
    to continue, and no worker is left running."""
    import os
    import signal
    import time
    from pathlib import Path

    recipe = write_recipe(over={"curriculum": {"stages": [
        {"name": "dense", "seq_len": 64, "phase": "dense", "steps": 5000}]}, "logging": {"interval_steps": 1}})
    exe = str(Path(sys.executable).with_name("v4launch"))
    proc = subprocess.Popen([exe, "run", str(recipe), "--no-progress"], cwd=workspace, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, COLUMNS="200"))
    deadline = time.monotonic() + 180
    for line in proc.stdout:  # wait until training steps are being logged
        if " step 3/" in line or time.monotonic() > deadline:
            break
    proc.send_signal(getattr(signal, signame))
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, (out[-2000:], err[-2000:])
    text = " ".join((out + err).split())
    assert "stopped at step" in text and "continue with `v4launch resume" in text and "Traceback" not in text
    run_dir = next((workspace / "runs").iterdir())
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and 3 <= int(ckpt.name.split("_")[1]) < 5000
    launch = json.loads((run_dir / "launch.json").read_text())
    for pid in launch["pids"]:  # the workers exited (the launcher waited for them)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_resume_of_a_completed_run_starts_nothing(new_run):
    run = new_run()
    assert train(run, progress=False).status == "completed"
    metrics = (run / "metrics.jsonl").read_text()
    code, text = _cli("resume", str(run))
    text = " ".join(text.split())
    assert code == 0 and "has completed its curriculum" in text and "step 8 of 8" in text, text
    assert "curriculum.stages.2.steps=" in text
    assert (run / "metrics.jsonl").read_text() == metrics  # no worker ran, nothing was logged
    # more steps through an override: then there is something to resume
    code, text = _cli("resume", str(run), "curriculum.stages.2.steps=3", "--dry-run")
    assert code == 0 and "has completed" not in text and "dry run" in text


def test_checkpoint_option_rolls_back_and_sets_the_newer_ones_aside(new_run):
    from v4launch.checkpoints import list_checkpoints

    run = new_run()
    train(run, max_steps=4, progress=False)  # checkpoints at step 3 (end of dense) and 4 (the stop)
    ckpts = run / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000003", "step_00000004"]
    code, text = _cli("resume", str(run), "--checkpoint", "2", "--dry-run")
    assert code == 2 and "not a complete checkpoint" in text and "step_00000003, step_00000004" in text
    code, text = _cli("resume", str(run), "--checkpoint", " ", "--dry-run")
    assert code == 2 and "--checkpoint is empty" in text and "a step (e.g. 120)" in text
    code, text = _cli("resume", str(run), "--checkpoint", "3", "--dry-run", "--json")
    report = json.loads(text[text.index("{"):text.rindex("}") + 1])
    assert code == 0 and report["checkpoint"].endswith("step_00000003") and report["set_aside"] == ["step_00000004"]
    assert (ckpts / "step_00000004").is_dir()  # a dry run moves nothing
    code, text = _cli("resume", str(run), "--checkpoint", "step_00000003")
    assert code == 0, text
    assert (ckpts / "abandoned-step_00000004").is_dir() and "set aside abandoned-step_00000004" in text
    transitions = next(line for line in text.splitlines() if line.startswith("transitions: "))
    assert transitions.count("dense -> warmup at step 3") == 1, transitions  # the abandoned history is not summarised
    assert latest_checkpoint(ckpts).name == "step_00000008"  # 3 kept, then steps 4..8 trained again
    code, text = _cli("resume", str(run), "--checkpoint", "abandoned-step_00000004", "--dry-run")
    assert code == 2 and "set aside by an earlier rollback" in text and "rename it back to step_00000004" in text
    step4 = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train" and r["step"] == 4]
    assert len(step4) == 2 and step4[0]["lm_loss"] == step4[1]["lm_loss"]  # the replayed step is bitwise the same
    code, text = _cli("status", str(run))
    assert code == 0 and "rolled back: abandoned-step_00000004 set aside" in text
    code, text = _cli("status", str(run), "--json")
    assert json.loads(text[text.index("{"):text.rindex("}") + 1])["set_aside"] == ["abandoned-step_00000004"]


def test_summary_timeline_drops_what_a_resume_replays():
    from v4launch.cli.run import current_timeline

    def ev(step, name):
        return {"kind": "event", "event": name, "step": step}

    recs = [ev(0, "start"), *({"kind": "train", "step": s} for s in (1, 2, 3)), {"kind": "eval", "step": 3},
            ev(3, "checkpoint"), ev(3, "phase"), {"kind": "train", "step": 4}, {"kind": "train", "step": 5},
            ev(5, "checkpoint"),
            ev(3, "start"), ev(3, "phase"), {"kind": "train", "step": 4}]  # rolled back to step 3
    kept = current_timeline(recs)
    assert [(r["kind"], r.get("event"), r["step"]) for r in kept] == [
        ("event", "start", 0), ("train", None, 1), ("train", None, 2), ("train", None, 3), ("eval", None, 3),
        ("event", "checkpoint", 3), ("event", "start", 3), ("event", "phase", 3), ("train", None, 4)]
    assert current_timeline(recs[:9]) == recs[:9]  # no resume: everything


def test_tensorboard_shows_each_step_once_after_a_rollback(new_run):
    """The steps a rollback replays are logged again; TensorBoard hides the abandoned ones (the
    resumed writer purges from the checkpoint's step on), so every step has exactly one value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = new_run({"logging": {"tensorboard": True}})
    train(run, max_steps=4, progress=False)  # checkpoints at steps 3 and 4
    code, text = _cli("resume", str(run), "--checkpoint", "3")
    assert code == 0, text
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("loss/lm")]
    assert steps == sorted(set(steps)) == list(range(1, 9)), steps
    replayed = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if r["kind"] == "train" and r["step"] == 4]
    assert len(replayed) == 2  # metrics.jsonl keeps both attempts; TensorBoard shows the current one
    assert [e.value for e in acc.Scalars("loss/lm") if e.step == 4] == [pytest.approx(replayed[1]["lm_loss"])]


@pytest.mark.parametrize("command", ["run", "resume"])
def test_max_steps_below_one_is_a_usage_error_that_creates_nothing(tmp_path, monkeypatch, command):
    """``--max-steps 0`` used to make an empty run directory (no step, no checkpoint); now typer refuses
    it (exit 2, naming the option and its range) before a recipe is read or a directory written."""
    monkeypatch.chdir(tmp_path)
    code, text = _cli(command, "--max-steps", "0")
    flat = " ".join(text.replace("│", " ").split())
    assert code == 2 and "--max-steps" in flat and "greater than or equal to 1" in flat, text
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_refusal_with_an_aspect_no_flag_allows_says_so_instead_of_naming_flags():
    """A tiny run resumed with Flash's recipe is refused for parameter shapes (no flag allows that) and for the
    layer schedule and optimizer groups (flags do): the hint named the two flags, which only led to a second
    refusal. It now says that no flag allows the shape change and to start a new run."""
    from pathlib import Path
    from types import SimpleNamespace

    from v4launch.training.resume import refusal

    def item(aspect, override):
        return SimpleNamespace(aspect=aspect, reason=f"{aspect} changes", override=override)

    def plan(*items):
        return SimpleNamespace(run_dir=Path("runs/r"), checkpoint=Path("step_00000003"),
                               report=SimpleNamespace(refused=items))

    mixed = refusal(plan(item("layer schedule", "--allow-layer-change"), item("architecture", None),
                         item("optimizer groups", "--allow-optimizer-regroup")))
    assert "architecture: no flag allows this" in mixed.hint and "v4launch run" in mixed.hint
    assert "--allow" not in mixed.hint and "--allow-layer-change" in mixed.message  # each aspect still names its flag
    flags_only = refusal(plan(item("layer schedule", "--allow-layer-change")))
    assert flags_only.hint == "if you accept the consequences, add --allow-layer-change"


def test_a_layer_added_on_resume_is_refused_before_launch_and_the_checkpoint_not_called_damaged(stopped_run):
    """A fifth layer with the layer-schedule and optimizer flags was accepted, then the job failed loading
    (``Missing key``), said the intact checkpoint was damaged and advised moving it aside. Now the plan
    refuses it (model tensors: no flag allows it), and the loader, if reached, says what is missing."""
    import torch

    from v4launch.checkpoints import load_checkpoint
    from v4launch.checkpoints.base import CheckpointError

    args = ("model.n_layers=5", "model.compress_ratios=[0,4,128,4,4,0]")
    code, text = _cli("resume", str(stopped_run), *args, "--allow-layer-change", "--allow-optimizer-regroup",
                      "--dry-run")
    flat = " ".join(text.split())
    assert code == 1 and "model tensors" in flat and "no flag allows" in flat, text
    assert "start a new run" in flat and "damaged" not in flat
    assert "decoder_ratios" not in flat and "widths unchanged" in flat  # the table does not call it shape-neutral
    code, text = _cli("resume", str(stopped_run), "--dry-run")  # the run itself is untouched and resumable
    assert code == 0, text
    ckpt = latest_checkpoint(stopped_run / "checkpoints")
    with pytest.raises(CheckpointError) as err:  # the loader's own message for a tensor the checkpoint lacks
        load_checkpoint(ckpt, {"model": {"layers.4.extra": torch.zeros(2)}})
    assert "has no tensor" in err.value.message and "intact" in err.value.message and "damaged" not in err.value.message


def test_resume_max_steps_not_past_the_checkpoint_is_refused(stopped_run):
    """``--max-steps`` counts the run's steps: 2 with a checkpoint at step 3 started the workers, loaded the
    checkpoint and stopped at once, saying nothing. Now a usage error names the checkpoint's step."""
    code, text = _cli("resume", str(stopped_run), "--max-steps", "2")
    flat = " ".join(text.split())
    assert code == 2 and "--max-steps 2 is not past checkpoint step_00000003 (step 3)" in flat, text
    assert "--max-steps 103" in flat and "architecture" not in flat  # before the compatibility table
    assert _cli("resume", str(stopped_run), "--max-steps", "4", "--dry-run")[0] == 0


def test_the_step_log_counts_to_max_steps(new_run, capsys):
    """With a step cap the log said ``step 1/150 … eta 3m00s`` for a run that stops at step 2."""
    run = new_run({"logging": {"interval_steps": 1}})
    train(run, max_steps=2, progress=False)
    out = capsys.readouterr()
    text = out.out + out.err
    assert " step 1/2 " in text and " step 2/2 " in text and "/150" not in text, text[-2000:]


def test_a_damaged_metadata_file_in_the_tensor_check_is_a_refusal_not_a_traceback(stopped_run):
    """The layer-change check reads the checkpoint's DCP metadata; truncated, it raised the unpickler's error."""
    ckpt = latest_checkpoint(stopped_run / "checkpoints")
    meta = ckpt / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    code, text = _cli("resume", str(stopped_run), "model.n_layers=5", "model.compress_ratios=[0,4,128,4,4,0]",
                      "--allow-layer-change", "--dry-run")
    flat = " ".join(text.split())
    assert code == 1 and f"checkpoint {ckpt} cannot be read" in flat and "--checkpoint STEP" in flat, text


def test_summary_compares_held_out_losses_only_where_stages_read_the_same_documents():
    """Stage-end evaluations read each stage's first held-out micro-batches at its seq_len: the summary gives the
    change where two consecutive stage ends share a seq_len and says why not where they do not."""
    import random

    from v4launch.cli.run import held_out_lines

    losses = [round(random.uniform(1.5, 3.0), 4) for _ in range(4)]
    evals = [{"kind": "eval", "at": "stage_end", "stage": name, "phase": phase, "seq_len": seq, "lm_loss": loss}
             for (name, phase, seq), loss in zip([("dense_512", "dense", 512), ("warmup_512", "warmup", 512),
                                                  ("sparse_2k", "sparse", 2048)], losses)]
    evals.insert(1, {"kind": "eval", "at": "interval", "stage": "dense_512", "seq_len": 512, "lm_loss": losses[3]})
    lines = held_out_lines(evals)
    assert lines[0] == f"held-out lm loss at stage end: {losses[2]:.4f} (stage sparse_2k)"
    assert len(lines) == 5 and lines[2].split()[-1] == f"{losses[0]:.4f}"  # the interval evaluation is not listed
    assert f"({losses[1] - losses[0]:+.4f} on the same documents)" in lines[3]
    assert "not comparable with warmup_512: other documents, rows of 2,048 tokens, not 512" in lines[4]
    older = [{k: v for k, v in r.items() if k != "seq_len"} for r in evals]  # records written before seq_len
    assert held_out_lines(older) == lines[:1] and held_out_lines([]) == []
