"""`v4launch submit`: validate a recipe, freeze it with the code revision, submit it to Slurm."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import UsageError, V4LaunchError
from .common import OUT, JsonOpt, OverridesArg, current_workspace, recipe_and_overrides, split_recipe_arg

HELP = ("Validate RECIPE, freeze it and the code revision into a new run directory, and submit it to "
        "Slurm (one task per GPU; the whole curriculum runs, stage after stage, with checkpoint-and-requeue "
        "on preemption and time limits). Exit 0 submitted, 1 contract violation / refused, 2 usage.")
EXAMPLES = """Examples:

  v4launch submit recipes/flash_8n.yaml --nodes 8

  v4launch submit --nodes 2                       # the workspace's recipe

  v4launch submit recipes/flash_4n.yaml --dry-run        # every stage's job; the sbatch scripts in a folder

  v4launch submit recipes/tiny_cpu.yaml --nodes 1 --dry-run-dir job/ --json

  v4launch submit recipes/tiny_cpu.yaml --allow-dirty   # uncommitted code: its diff is saved in the run
"""

RecipeArg = Annotated[str | None, typer.Argument(
    help="Recipe YAML; default: the workspace's recipe (the one last validated or run).", show_default=False)]
NodesOpt = Annotated[int | None, typer.Option("--nodes", "-N", min=1, help="Nodes (overrides cluster.nodes).",
                                              show_default=False)]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help=(
    "Submit nothing: print every stage's job (nodes, time limit, what queues it, what it resumes from) and write the "
    "exact sbatch scripts, the frozen recipe and chain.json into a folder (path printed; --json: the chain as JSON)."))]
DryRunDirOpt = Annotated[Path | None, typer.Option(
    "--dry-run-dir", metavar="DIR", show_default=False,
    help="Where --dry-run writes (implies --dry-run); default: .v4launch/dry-run/<run name> in the workspace.")]
AllowDirtyOpt = Annotated[bool, typer.Option(
    "--allow-dirty", help="Submit from a source tree with uncommitted changes (the diff goes into the run directory).")]


def submit(recipe: RecipeArg = None, overrides: OverridesArg = None, nodes: NodesOpt = None,
           dry_run: DryRunOpt = False, allow_dirty: AllowDirtyOpt = False, json_out: JsonOpt = False,
           dry_run_dir: DryRunDirOpt = None) -> None:
    """Validate, freeze and submit a recipe to Slurm (or show every stage's job with --dry-run)."""
    from ..slurm.submit import check_clean, code_revision, prepare_run, submit_run
    from ..training.recipe_io import check_recipe, load_recipe
    from .run import check_profile_env

    check_profile_env()  # the jobs inherit the environment: refuse a malformed one before anything is queued
    ws = current_workspace()
    name, extra = split_recipe_arg(recipe, list(overrides or []), "submit")
    path, extra = recipe_and_overrides(ws, name, extra)
    if nodes is not None:
        given = [o for o in extra if o.replace(" ", "").startswith("cluster.nodes=")]
        last = given[-1].split("=", 1)[1].strip() if given else None  # the override that would apply
        if last is not None and last.isdigit() and int(last) != nodes:
            typed = given[-1] in (overrides or [])
            if typed:
                hint = (f"give the node count once: drop --nodes to keep {given[-1]} (e.g. a fix pasted from "
                        f"`v4launch validate`), or drop {given[-1]}")
            else:  # remembered by the workspace from the last `validate`, not typed here
                hint = (f"{given[-1]} is one of the overrides the workspace remembers from the last `v4launch validate` "
                        f"of {path}: drop --nodes to submit with them, name the recipe to run it as written "
                        f"(`v4launch submit {path} --nodes {nodes}`), or validate again with the overrides you want")
            raise UsageError(f"--nodes {nodes} and the override {given[-1]} disagree", hint=hint)
        extra.append(f"cluster.nodes={nodes}")
    loaded = load_recipe(path, extra)
    for warning in check_recipe(loaded):
        OUT.note(f"warning: {warning}")
    rev = code_revision()
    if dry_run or dry_run_dir is not None:
        _dry_run(loaded, ws, dry_run_dir, json_out)
        OUT.note("dry run: nothing submitted (the run directory's name carries the submission time)"
                 + ("; note: the source tree is dirty" if rev.dirty else ""))
        return
    check_clean(rev, allow_dirty)
    run_dir = prepare_run(loaded, rev, workspace=ws)
    try:
        job_id = submit_run(run_dir, stage=0, detail=f"submitted {path} with {len(extra)} override(s)")
    except V4LaunchError:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: do not leave an empty run behind
        raise
    ws.remember_recipe(str(loaded.path), extra)
    if json_out:
        OUT.json({"run_dir": str(run_dir), "job_id": job_id, "recipe": str(path), "git_sha": rev.sha,
                  "dirty": rev.dirty})
        return
    OUT.console.print(f"submitted Slurm job {job_id} for run {run_dir}", markup=False)
    if rev.dirty:
        OUT.note(f"the source tree is dirty: its diff is saved in {run_dir / 'code.diff'}")
    quoted = shlex.quote(str(run_dir))
    OUT.console.print(f"  v4launch status {quoted}\n  v4launch logs {quoted} --follow", markup=False, soft_wrap=True)


def _dry_run(loaded: Any, ws: Any, folder: Path | None, json_out: bool) -> None:
    """Write every stage's job into ``folder`` (default under the workspace) and print the chain (or its JSON)."""
    from rich.table import Table

    from ..slurm.dry_run import DRY_RUN_DIR, write_dry_run
    from ..slurm.submit import predicted_run_dir
    from ..training.plan import plan_curriculum
    from ..workspace import STATE_DIR

    recipe = loaded.recipe
    run_dir = predicted_run_dir(recipe, ws)
    plans = plan_curriculum(recipe, recipe.cluster.world_size)
    dry = write_dry_run(loaded, plans, run_dir, folder or ws.root / STATE_DIR / DRY_RUN_DIR / run_dir.name)
    if json_out:
        OUT.json(dry.to_dict())
        return
    con, s = OUT.console, recipe.slurm
    con.print(f"{recipe.name}: {len(dry.jobs)} Slurm job(s), one per stage, each on {recipe.cluster.nodes} node(s) x "
              f"{recipe.cluster.gpus_per_node} GPU(s); a job runs up to slurm.time_min = {s.time_min} min, then "
              "checkpoints and requeues itself until its stage is done", markup=False, soft_wrap=True)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("stage", "phase", "seq_len", "cp x dp", "steps", "global steps", "est. wall", "queued by",
                   "resumes from", "script"):
        table.add_column(column)
    for j in dry.jobs:
        est = "-" if j.est_wall_h is None else f"{j.est_wall_h:.1f} h = {j.est_segments} x {s.time_min} min"
        table.add_row(f"{j.index} {j.name}", j.phase, str(j.seq_len), f"{j.cp} x {j.dp}", str(j.steps),
                      f"{j.first_step}-{j.first_step + j.steps}", est,
                      "this submit" if j.index == 0 else f"stage {j.index - 1}'s end",
                      "step 0" if j.index == 0 else f"stage {j.index - 1} checkpoint", j.script)
    con.print(table)
    con.print(f"written: {dry.folder} (the sbatch scripts, identical for every stage: a job finds its stage and "
              f"step in the run's checkpoints; recipe.yaml; chain.json; AT_SUBMIT.txt)", markup=False, soft_wrap=True)
    con.print(f"the run directory would be {dry.run_dir}; first job's resume point: {dry.jobs[0].resume}",
              markup=False, soft_wrap=True)
