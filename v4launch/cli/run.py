"""`v4launch run`: validate a recipe, prepare its data, create a run directory and train it here."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import OUT, OverridesArg, current_workspace, recipe_and_overrides, split_recipe_arg

HELP = ("Train RECIPE on this machine: validate it (refused with exit 1 on a contract violation), prepare "
        "its data, create a run directory under the workspace's run.output_root, and run every curriculum "
        "stage (world size = cluster.nodes x cluster.gpus_per_node processes on this host; a stage with "
        "context-parallel size cp runs world/cp data-parallel replicas of cp ranks). Ctrl-C or "
        "`v4launch cancel RUN` stops after the current step with a checkpoint; `v4launch resume` continues.")
EXAMPLES = """Examples:

  v4launch run recipes/tiny_cpu.yaml

  v4launch run                                          # the workspace's recipe

  v4launch run recipes/tiny_cpu.yaml optimizer.lr=1e-3 --max-steps 20 --no-progress
"""

RecipeArg = Annotated[str | None, typer.Argument(
    help="Recipe YAML; default: the workspace's recipe (the one last validated or run).", show_default=False)]
MaxStepsOpt = Annotated[int | None, typer.Option(
    "--max-steps", min=1, help="Stop (with a checkpoint) once the run has done N optimizer steps (N >= 1).",
    show_default=False)]
NoProgressOpt = Annotated[bool, typer.Option("--no-progress", help="Plain log lines instead of the progress display.")]


def refuse_what_this_machine_cannot_run(recipe) -> None:
    """For a job that runs on this machine, before anything is written: refuse a recipe sized for GPUs when this
    machine lacks them (``training.runner.refuse_missing_gpus``: none, or fewer than the local launcher's
    nodes x gpus_per_node processes), and one that compiles (``compile.enable``) when the compiler backend
    cannot run here (``training.runner.refuse_missing_toolchain``: inductor on a CPU without a C++ compiler).
    Raises their ``V4LaunchError`` (exit 2); the job checks again where it runs."""
    import torch

    from ..training.runner import refuse_missing_gpus, refuse_missing_toolchain

    c = recipe.cluster
    refuse_missing_gpus(c.gpu, c.nodes * c.gpus_per_node - 1, torch.cuda.device_count())
    if recipe.compile.enable:
        refuse_missing_toolchain(recipe.compile.backend, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def run(recipe: RecipeArg = None, overrides: OverridesArg = None, max_steps: MaxStepsOpt = None,
        no_progress: NoProgressOpt = False) -> None:
    """Validate, prepare data, create the run directory, train locally, print a summary."""
    from ..data import get_tokenizer, prepare_dataset
    from ..launchers import LocalLauncher
    from ..rundir import code_revision, create_run_dir, record_code, update_run_extra
    from ..training.recipe_io import check_recipe, load_recipe

    check_profile_env()  # before a run directory exists: a bad V4LAUNCH_PROFILE_STEPS must not leave a failed run
    ws = current_workspace()
    name, extra = split_recipe_arg(recipe, list(overrides or []), "run")
    path, extra = recipe_and_overrides(ws, name, extra)
    loaded = load_recipe(path, extra)
    for warning in check_recipe(loaded):
        OUT.note(f"warning: {warning}")
    ws.remember_recipe(str(loaded.path), extra)
    r = loaded.recipe
    refuse_what_this_machine_cannot_run(r)  # before data and a run directory exist (the job checks again where it runs)
    dataset = prepare_dataset(r.data, get_tokenizer(r.data.tokenizer), workspace=ws)
    OUT.console.print(f"data: {dataset.num_documents} documents, {dataset.num_tokens:,} tokens "
                      f"({'reused' if dataset.reused else 'prepared'}); unigram entropy "
                      f"{dataset.entropy_bits:.3f} bits/token = {dataset.entropy_nats:.3f} nats/token")
    run_dir = create_run_dir(loaded, "local", {"data_prefix": str(dataset.prefix),
                                               "unigram_entropy_nats": dataset.entropy_nats,
                                               "unigram_entropy_bits": dataset.entropy_bits,
                                               "overrides": extra}, workspace=ws)
    rev = code_revision()  # the checkout v4launch runs from (as `submit` records it), wherever the workspace is
    update_run_extra(run_dir, record_code(run_dir, rev))
    if rev.dirty:
        OUT.note(f"the source tree is dirty: its diff is saved in {run_dir / 'code.diff'}")
    ws.remember(run=str(run_dir))
    OUT.console.print(f"run directory: [bold]{run_dir}[/bold]")
    info = LocalLauncher().launch(run_dir, max_steps=max_steps, progress=not no_progress)
    print_summary(run_dir, info.result, dataset.entropy_nats)
    exit_if_stopped(run_dir, info.result)


def check_profile_env() -> None:
    """Refuse a malformed ``V4LAUNCH_PROFILE_STEPS`` (training/step_profile.py) before anything starts.

    Raises:
        UsageError: the variable is set but not ``first:last`` with 1 <= first <= last.
    """
    from ..training.step_profile import ENV, parse_steps

    if os.environ.get(ENV, "").strip():
        parse_steps(os.environ[ENV])


EXIT_STOPPED = 130  # the shell's code for an interrupt: stopped by Ctrl-C / SIGTERM, checkpoint saved


def exit_if_stopped(run_dir: Path, result: Any) -> None:
    """A run stopped by a signal before its curriculum ended exits 130 and says how to continue.

    Raises:
        typer.Exit: code 130 when ``result.status == "stopped"``; nothing otherwise ("completed",
            or "max_steps" asked for with --max-steps, exit 0).
    """
    if result is not None and result.status == "stopped":
        OUT.note(f"stopped at step {result.step} before the curriculum ended (checkpoint saved): "
                 f"continue with `v4launch resume {shlex.quote(str(run_dir))}`")
        raise typer.Exit(EXIT_STOPPED)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's metrics.jsonl."""
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def current_timeline(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the run's current history. A ``start`` event at step s (a resume from the
    checkpoint of step s) supersedes what earlier attempts logged after that checkpoint: train and
    eval records past s, and events from s on other than checkpoints and starts (a rollback with
    ``resume --checkpoint``, or steps a crashed attempt ran past its last checkpoint, are replayed)."""
    out: list[dict[str, Any]] = []
    for r in recs:
        if r.get("kind") == "event" and r.get("event") == "start" and out:
            s = r.get("step", 0)
            out = [x for x in out if not (x.get("step", 0) > s or (
                x.get("kind") == "event" and x.get("step", 0) == s and x.get("event") not in ("checkpoint", "start")))]
        out.append(r)
    return out


def held_out_lines(evals: list[dict[str, Any]]) -> list[str]:
    """The summary's held-out lines: the last stage-end loss, then one line per stage end with its change from the
    previous stage end when the two read the same documents (the same seq_len: the held-out micro-batches are the
    stage's rows), else why the two are not comparable. Records without ``seq_len`` (older runs) give the first
    line only. [] without evaluations."""
    if not evals:
        return []
    lines = [f"held-out lm loss at stage end: {evals[-1]['lm_loss']:.4f} (stage {evals[-1]['stage']})"]
    ends = [r for r in evals if r.get("at") == "stage_end" and r.get("seq_len")]
    if len(ends) < 2:
        return lines
    lines.append("held-out lm loss at each stage end (the stage's first held-out micro-batches at its seq_len: the "
                 "same documents only where the seq_len is the same):")
    width = max(len(str(r["stage"])) for r in ends)
    for prev, r in zip([None, *ends], ends):
        head = f"  {r['stage']:<{width}}  {r.get('phase', '?'):<6}  seq_len {r['seq_len']:>7,}  {r['lm_loss']:.4f}"
        if prev is None:
            lines.append(head)
        elif prev["seq_len"] == r["seq_len"]:
            lines.append(f"{head}  ({r['lm_loss'] - prev['lm_loss']:+.4f} on the same documents)")
        else:
            lines.append(f"{head}  (not comparable with {prev['stage']}: other documents, rows of {r['seq_len']:,} "
                         f"tokens, not {prev['seq_len']:,})")
    return lines


def print_summary(run_dir: Path, result: Any, entropy_nats: float | None) -> None:
    """Final LM loss vs the unigram entropy, phase transitions, checkpoint and metrics paths, over the
    run's current history (:func:`current_timeline`)."""
    recs = current_timeline(read_metrics(run_dir))
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    phases = [r for r in recs if r.get("kind") == "event" and r.get("event") == "phase"]
    stage = next((r.get("stage") for r in reversed(recs) if r.get("stage_index") == result.stage_index), None)
    OUT.console.print(f"summary of {run_dir.name}: [bold]{result.status}[/bold], {result.step} steps, last stage "
                      f"#{result.stage_index}{f' {stage}' if stage else ''}")
    if train:
        last = train[-1]
        same_stage = [r for r in train if r.get("stage") == last.get("stage")]
        tail = same_stage[-min(10, len(same_stage)):]  # never mixes an earlier stage's (higher) losses in
        avg = sum(r["lm_loss"] for r in tail) / len(tail)
        line = (f"training lm loss: {last['lm_loss']:.4f} nats/token at step {last.get('step')} (the last logged), "
                f"{avg:.4f} averaged over the last {len(tail)} logged steps of stage {last.get('stage')}")
        if entropy_nats:
            line += f"; unigram entropy of the text {entropy_nats:.4f} nats/token"
        OUT.console.print(line)
        sums = ", ".join(f"{k} {v:.4f}" for k, v in sorted(last.get("aux_sum", {}).items()))
        OUT.console.print(f"aux losses (raw, summed per kind): {sums or 'none'}")
    for line in held_out_lines(evals):
        OUT.console.print(line)
    OUT.console.print("transitions: " + (", ".join(f"{p['old']} -> {p['new']} at step {p['step']}" for p in phases)
                                         or "none"))
    OUT.console.print(f"checkpoint: {result.checkpoint}")
    OUT.console.print(f"metrics: {Path(run_dir) / 'metrics.jsonl'} (TensorBoard: {Path(run_dir) / 'tb'})")
