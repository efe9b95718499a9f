"""`v4launch submit`: validate a recipe, freeze it with the code revision, submit it to Slurm."""

from __future__ import annotations

import shlex
import shutil
import sys
from typing import Annotated

import typer

from ..errors import UsageError, V4LaunchError
from .common import OUT, JsonOpt, OverridesArg, recipe_and_overrides, split_recipe_arg

HELP = ("Validate RECIPE, freeze it and the code revision into a new run directory, and submit it to "
        "Slurm (one task per GPU; the whole curriculum runs, stage after stage, with checkpoint-and-requeue "
        "on preemption and time limits). Exit 0 submitted, 1 contract violation / refused, 2 usage.")
EXAMPLES = """Examples:

  v4launch submit recipes/flash_8n.yaml --nodes 8

  v4launch submit --nodes 2                       # the workspace's recipe

  v4launch submit recipes/tiny_cpu.yaml --nodes 1 curriculum.stages.0.steps=4 --dry-run > job.sbatch

  v4launch submit recipes/tiny_cpu.yaml --allow-dirty   # uncommitted code: its diff is saved in the run
"""

RecipeArg = Annotated[str | None, typer.Argument(
    help="Recipe YAML; default: the workspace's recipe (the one last validated or run).", show_default=False)]
NodesOpt = Annotated[int | None, typer.Option("--nodes", "-N", min=1, help="Nodes (overrides cluster.nodes).",
                                              show_default=False)]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the exact sbatch script on stdout; submit nothing.")]
AllowDirtyOpt = Annotated[bool, typer.Option(
    "--allow-dirty", help="Submit from a source tree with uncommitted changes (the diff goes into the run directory).")]


def submit(recipe: RecipeArg = None, overrides: OverridesArg = None, nodes: NodesOpt = None,
           dry_run: DryRunOpt = False, allow_dirty: AllowDirtyOpt = False, json_out: JsonOpt = False) -> None:
    """Validate, freeze and submit a recipe to Slurm (or print its sbatch script with --dry-run)."""
    from ..slurm.submit import check_clean, code_revision, dry_run_script, prepare_run, submit_run
    from ..training.recipe_io import check_recipe, load_recipe
    from ..workspace import Workspace
    from .run import check_profile_env

    check_profile_env()  # the jobs inherit the environment: refuse a malformed one before anything is queued
    ws = Workspace.current()
    name, extra = split_recipe_arg(recipe, list(overrides or []), "submit")
    path, extra = recipe_and_overrides(ws, name, extra)
    if nodes is not None:
        given = [o for o in extra if o.replace(" ", "").startswith("cluster.nodes=")]
        last = given[-1].split("=", 1)[1].strip() if given else None  # the override that would apply
        if last is not None and last.isdigit() and int(last) != nodes:
            raise UsageError(f"--nodes {nodes} and the override {given[-1]} disagree",
                             hint=f"give the node count once: drop --nodes to keep {given[-1]} (e.g. a fix pasted "
                                  f"from `v4launch validate`), or drop {given[-1]}")
        extra.append(f"cluster.nodes={nodes}")
    loaded = load_recipe(path, extra)
    for warning in check_recipe(loaded):
        OUT.note(f"warning: {warning}")
    rev = code_revision()
    if dry_run:
        sys.stdout.write(dry_run_script(loaded, ws))
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
