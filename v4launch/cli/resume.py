"""`v4launch resume`: check a resume against the run's latest checkpoint, then relaunch it where it ran."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from ..errors import UsageError
from .common import OUT, JsonOpt, OverridesArg
from .run import MaxStepsOpt, NoProgressOpt, check_profile_env, refuse_what_this_machine_cannot_run
from .status import resolve_run

HELP = ("Resume RUN (default: the workspace's newest run) from its latest complete checkpoint (or --checkpoint). The checkpoint's "
        "manifest is compared with the recipe (the run's frozen one, or --recipe / overrides) and the requested stage "
        "or phase; every aspect, and every recipe field that differs from the checkpoint's recipe, is safe, applied "
        "(from the resume step, with what that means), reshard or refused with the --allow-* flag that overrides it. "
        "Refused: exit 1, nothing written. Otherwise re-freezes the new recipe into the run, writes resume.json and "
        "relaunches on the run's launcher (local in the foreground, or Slurm).")
EXAMPLES = """Examples:

  v4launch resume                                   # newest run, continue where it stopped

  v4launch resume runs/tiny_cpu-20260101-120000 --phase sparse

  v4launch resume RUN --recipe recipes/tiny_cpu.yaml cluster.gpus_per_node=2 --dry-run

  v4launch resume RUN --stage 0 --allow-phase-regression

  v4launch resume RUN --checkpoint 120 --dry-run     # roll back to step 120 (newer ones set aside)

  v4launch resume RUN data.seed=7 --dry-run          # the report says the data order changes from the checkpoint

  v4launch resume RUN --max-steps 200 --no-progress
"""

RunArg = Annotated[str | None, typer.Argument(help="Run directory (or its name under the workspace's runs/); default: the "
                                              "workspace's newest run.", show_default=False)]
PhaseOpt = Annotated[Literal["dense", "warmup", "sparse"] | None, typer.Option(
    "--phase", help="Continue at the first stage with this phase at or after the checkpoint's stage.",
    show_default=False)]
StageOpt = Annotated[str | None, typer.Option("--stage", help="Continue at this stage (index or name), from its start.",
                                              show_default=False)]
RecipeOpt = Annotated[Path | None, typer.Option("--recipe", help="New recipe for the rest of the run (re-frozen).",
                                                show_default=False)]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the compatibility report; launch nothing.")]
CheckpointOpt = Annotated[str | None, typer.Option(
    "--checkpoint", help="Resume from this checkpoint (a step, or a step_* directory) instead of the latest; the "
                         "complete checkpoints after it are renamed abandoned-step_* before the relaunch.",
    show_default=False)]


def _flag(name: str, what: str):
    return Annotated[bool, typer.Option(name, help=what)]


AllowLayer = _flag("--allow-layer-change", "Accept a changed layer schedule (compress_ratios, layers, MTP depth).")
AllowPhase = _flag("--allow-phase-regression", "Accept going back to an earlier phase or stage.")
AllowRegroup = _flag("--allow-optimizer-regroup", "Accept changed optimizer groups or parameter dtypes.")
AllowTokenizer = _flag("--allow-tokenizer-change", "Accept another tokenizer.")
AllowCold = _flag("--allow-cold-indexer", "Accept sparse attention with an indexer that never trained in warm-up.")


def resume(run: RunArg = None, overrides: OverridesArg = None, phase: PhaseOpt = None, stage: StageOpt = None,
           recipe: RecipeOpt = None, allow_layer_change: AllowLayer = False, allow_phase_regression: AllowPhase = False,
           allow_optimizer_regroup: AllowRegroup = False, allow_tokenizer_change: AllowTokenizer = False,
           allow_cold_indexer: AllowCold = False, checkpoint: CheckpointOpt = None, dry_run: DryRunOpt = False,
           max_steps: MaxStepsOpt = None, no_progress: NoProgressOpt = False, json_out: JsonOpt = False) -> None:
    """Check, then relaunch (or only report with --dry-run)."""
    from ..launchers import launcher_for
    from ..rundir import load_run
    from ..training.recipe_io import check_recipe, load_recipe
    from ..training.resume import plan_resume, refusal

    check_profile_env()  # the relaunched job inherits the environment: refuse a malformed one first
    extra = list(overrides or [])
    if run is not None and "=" in run and not Path(run).exists():
        run, extra = None, [run, *extra]
    run_dir = resolve_run(run)  # a path, a name under the workspace's runs/, or the newest run (said)
    info = load_run(run_dir)
    changed = recipe is not None or bool(extra)
    loaded = load_recipe(recipe or info.paths.recipe, extra) if changed else info.loaded
    if changed:
        for warning in check_recipe(loaded):
            OUT.note(f"warning: {warning}")
    flags = {"--allow-layer-change": allow_layer_change, "--allow-phase-regression": allow_phase_regression,
             "--allow-optimizer-regroup": allow_optimizer_regroup, "--allow-tokenizer-change": allow_tokenizer_change,
             "--allow-cold-indexer": allow_cold_indexer}
    plan = plan_resume(info.paths.root, loaded, stage=stage, phase=phase, allow=tuple(f for f, on in flags.items() if on),
                       checkpoint=checkpoint, launcher=info.launcher)
    done = plan.manifest.step
    if max_steps is not None and max_steps <= done:  # the job would load the checkpoint and stop at once
        raise UsageError(f"--max-steps {max_steps} is not past checkpoint {plan.checkpoint.name} (step {done}): "
                         "--max-steps counts the run's optimizer steps, not steps of this resume",
                         hint=f"pass a step after {done}, e.g. --max-steps {done + 100}, or leave it out")
    _show(plan, json_out)
    if not plan.report.ok:
        raise refusal(plan)
    stages = loaded.recipe.curriculum.stages
    total = sum(s.steps for s in stages)
    if done >= total and plan.stage_index == len(stages) - 1:  # nothing left: no workers to start
        OUT.console.print(f"run {info.paths.root.name} has completed its curriculum: checkpoint {plan.checkpoint.name} "
                          f"is at step {done} of {total}; nothing to resume (to train 100 more steps in the last stage: "
                          f"curriculum.stages.{len(stages) - 1}.steps={stages[-1].steps + 100})", markup=False)
        return
    if dry_run:
        OUT.note("dry run: nothing written, nothing launched")
        return
    launcher = launcher_for(info.paths.root)
    launcher.ensure_idle(info.paths.root)  # a refused resume writes nothing
    if info.launcher == "local":  # a Slurm job checks on the node that runs it
        refuse_what_this_machine_cannot_run(loaded.recipe)
    _accept(info, plan, loaded, changed)
    launched = launcher.launch(info.paths.root, max_steps=max_steps, progress=not no_progress)
    if launched.result is not None:
        from .run import exit_if_stopped, print_summary

        entropy = (load_run(info.paths.root).meta.get("extra") or {}).get("unigram_entropy_nats")
        print_summary(info.paths.root, launched.result, entropy)
        exit_if_stopped(info.paths.root, launched.result)
    elif launched.job_id:
        OUT.console.print(f"resumed as {launched.launcher} job [bold]{launched.job_id}[/bold]")


def _accept(info, plan, loaded, changed: bool) -> None:
    """Write the accepted resume into the run: a changed dataset prepared first (a local run pins it
    in run.json, as `run` does; a Slurm job prepares it itself), then the set-aside checkpoints,
    the re-frozen recipe and resume.json."""
    from ..rundir import refreeze_recipe, update_run_extra, write_resume_request
    from ..training.resume import set_aside
    from ..workspace import Workspace

    pins: dict = {}
    if plan.data_changed and info.launcher == "local":
        from ..data import get_tokenizer, prepare_dataset

        r = loaded.recipe
        ds = prepare_dataset(r.data, get_tokenizer(r.data.tokenizer), workspace=Workspace.current(start=info.paths.root))
        OUT.console.print(f"data: {ds.num_documents} documents, {ds.num_tokens:,} tokens "
                          f"({'reused' if ds.reused else 'prepared'}) for the new data: section", markup=False)
        pins = {"data_prefix": str(ds.prefix), "unigram_entropy_nats": ds.entropy_nats,
                "unigram_entropy_bits": ds.entropy_bits}
    elif plan.data_changed:
        pins = {"data_prefix": None}  # the job prepares the new data: section
    for dest in set_aside(plan.newer) if plan.newer else ():
        OUT.note(f"set aside {dest.name} (after the checkpoint resumed from)")
    if changed:
        refreeze_recipe(info.paths.root, loaded, pins)
    elif pins:
        update_run_extra(info.paths.root, pins)
    write_resume_request(info.paths.root, plan.request())
    Workspace.current().remember(run=str(info.paths.root))


def _show(plan, json_out: bool) -> None:
    where = f"stage #{plan.stage_index} {plan.stage_name} ({plan.phase})"
    if json_out:
        OUT.json({"run_dir": str(plan.run_dir), "checkpoint": str(plan.checkpoint), "target": where,
                  "set_aside": [p.name for p in plan.newer], **plan.report.to_dict()})
        return
    OUT.console.print(f"checkpoint {plan.checkpoint} (step {plan.manifest.step}, stage {plan.manifest.stage_name}, "
                      f"phase {plan.manifest.phase}) → {where}")
    if plan.newer:
        OUT.console.print(f"rolls back past {len(plan.newer)} newer checkpoint(s) ("
                          + ", ".join(p.name for p in plan.newer) + "): renamed abandoned-step_* before the relaunch",
                          markup=False)
    OUT.console.print(plan.report.render())
