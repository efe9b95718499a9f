"""How ``v4launch resume`` decides: target stage and phase, the compatibility report, resume.json.

Decision (docs/training.md "How resume decides"):

1. the checkpoint is the run's latest complete one (``checkpoints/step_*`` with a complete manifest);
2. the recipe is the run's frozen recipe.yaml, or a new one (``--recipe``, overrides) that is then
   validated and re-frozen into the run directory;
3. the target stage is ``--stage`` (index or name), or the first stage with ``--phase`` at or after
   the checkpoint's stage (before it only as a regression), or else where the checkpoint left off
   (the next stage when it was saved at its stage's end);
4. ``v4launch.checkpoints.check_resume`` compares the manifest with that target (the target
   stage's ``dp = world / cp`` and ``cp``): every aspect is safe, reshard (DP / CP / world size
   changes; DCP redistributes, the data loader continues from its global position) or refused
   with the ``--allow-*`` flag that overrides it;
5. :func:`field_items` then lists every recipe field that differs between the checkpoint's recipe
   (``Manifest.recipe``, or the run's ``recipe.<hash>.yaml``) and the new one, each safe, applied
   (with what taking effect from the resume step means), reshard or refused: nothing the run would
   not do is reported safe;
6. on success resume.json records the checkpoint, the target stage and the flags; the job honours
   it once on its next start (it is renamed resume.done.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..checkpoints.listing import SET_ASIDE_PREFIX
from ..errors import RefusedError, UsageError
from ..recipe_yaml import as_written


@dataclass(frozen=True)
class ResumePlan:
    """A checked resume: what would load, where it continues, and the verdicts."""

    run_dir: Path
    checkpoint: Path
    manifest: Any
    stage_index: int
    stage_name: str
    phase: str
    explicit_stage: bool
    report: Any  # checkpoints.CompatReport
    allow: tuple[str, ...]
    newer: tuple[Path, ...] = ()  # complete checkpoints after ``checkpoint``: set aside before a rollback launches
    data_changed: bool = False  # the data: section differs from the checkpoint's: the dataset is prepared again

    def request(self) -> dict[str, Any]:
        """The resume.json payload."""
        return {"checkpoint": str(self.checkpoint), "stage_index": self.stage_index if self.explicit_stage else None,
                "stage": self.stage_name, "phase": self.phase, "allow": list(self.allow),
                "set_aside": [p.name for p in self.newer],
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "report": self.report.to_dict()}


def _stage_by_arg(recipe: Any, stage: str) -> int:
    names = [s.name for s in recipe.curriculum.stages]
    if stage.isdigit() and int(stage) < len(names):
        return int(stage)
    if stage in names:
        return names.index(stage)
    raise UsageError(f"--stage {stage}: no such stage; the recipe's stages are "
                     + ", ".join(f"{i}:{n}" for i, n in enumerate(names)), hint="pass a stage index or name")


def _stage_by_phase(recipe: Any, phase: str, after: int) -> int:
    stages = recipe.curriculum.stages
    for i in [*range(after, len(stages)), *range(0, after)]:
        if stages[i].phase == phase:
            return i
    raise UsageError(f"--phase {phase}: no stage of recipe {recipe.name} trains in phase {phase} "
                     f"(stages: {', '.join(f'{s.name}={s.phase}' for s in stages)})",
                     hint="add a stage with that phase (`--recipe NEW.yaml`) or pick another phase")


def target_stage(recipe: Any, manifest: Any, *, stage: str | None, phase: str | None) -> tuple[int, bool]:
    """(target stage index, whether it was asked for explicitly)."""
    if stage is not None and phase is not None:
        idx = _stage_by_arg(recipe, stage)
        if recipe.curriculum.stages[idx].phase != phase:
            raise UsageError(f"--stage {stage} trains in phase {recipe.curriculum.stages[idx].phase}, not {phase}",
                             hint="pass only one of --stage / --phase")
        return idx, True
    if stage is not None:
        return _stage_by_arg(recipe, stage), True
    if phase is not None:
        return _stage_by_phase(recipe, phase, min(manifest.stage_index, len(recipe.curriculum.stages) - 1)), True
    idx = min(manifest.stage_index, len(recipe.curriculum.stages) - 1)
    from .plan import plan_curriculum

    plans = plan_curriculum(recipe, recipe.cluster.world_size)
    done = int(manifest.extra.get("step_in_stage", 0)) >= plans[idx].steps
    return (idx + 1 if done and idx + 1 < len(plans) else idx), False


def param_groups_for(recipe: Any, phase: str, manifest: Any, same_recipe: bool) -> dict[str, Any]:
    """Optimizer-group summaries of the model as the job would build it for ``phase``.

    Reuses the manifest's when nothing changed; otherwise builds the model on the meta device
    (no memory; about a minute for full V4-Flash), its GEMM weights stored as ``precision.params_dtype`` says.
    """
    if same_recipe and phase == manifest.model_phase:
        return dict(manifest.param_groups)
    from ..checkpoints.base import describe_params
    from .optim import group_kind

    from ..model.parallel.fsdp import routed_expert_params
    from ..model.parallel.storage import apply_param_storage

    model = _meta_model(recipe, phase)
    par = recipe.parallel  # stored as the job's seam stores it (precision.params_dtype)
    apply_param_storage(model, recipe.precision.params_dtype, fsdp=par.distributed_optimizer,
                        unsharded=routed_expert_params([model]) if par.ep > 1 else ())
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        tag = "indexer" if ".indexer." in name else "base"
        groups.setdefault(f"{group_kind(name, p, recipe.optimizer.name)}/{tag}", []).append((name, p))
    return {g: describe_params(named) for g, named in groups.items()}


_META_MODEL: dict[tuple[str, str], Any] = {}


def _meta_model(recipe: Any, phase: str) -> Any:
    """``V4Model`` of ``recipe`` in ``phase`` on the meta device (no memory), the last one kept: a resume check
    asks for the same model twice when the target phase is the checkpoint's."""
    import torch

    from ..checkpoints.base import recipe_hash
    from ..model import V4Model
    from .model_adapter import model_args_from_recipe

    key = (recipe_hash(recipe), phase)
    if key not in _META_MODEL:
        _META_MODEL.clear()
        with torch.device("meta"):
            _META_MODEL[key] = V4Model(model_args_from_recipe(recipe), phase=phase)
    return _META_MODEL[key]


def tensors_item(recipe: Any, manifest: Any, ckpt: Path) -> Any:
    """``CompatItem("model tensors")``: refused (no flag) when the model the job builds to load ``ckpt`` (the
    checkpoint's model phase, as ``Runner._load``) has a tensor the checkpoint does not hold (DCP metadata):
    the load would fail (a layer added; a schedule giving a layer parameters of another kind). The layer-
    schedule flag accepts weights loading into layers of another type, not weights that do not exist.
    ``plan_resume`` asks only when the layer schedule changed (otherwise the tensors are the same).
    Raises RefusedError when the checkpoint's ``.metadata`` cannot be read (damaged; the hint names --checkpoint)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ..checkpoints.compat import CompatItem

    names = _meta_model(recipe, manifest.model_phase).state_dict().keys()
    try:
        held = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception as exc:  # a truncated or foreign .metadata: unpickling raises whatever it meets
        raise RefusedError(f"checkpoint {ckpt} cannot be read ({type(exc).__name__}: {str(exc)[:120]}): its .metadata "
                           "is damaged", hint="resume from another complete checkpoint with --checkpoint STEP") from None
    missing = [n for n in names if f"model.{n}" not in held]
    if not missing:
        return CompatItem("model tensors", "safe", "every tensor the model loads is in the checkpoint")
    return CompatItem("model tensors", "refused", f"the checkpoint holds no weights for {len(missing)} tensor(s) of "
                      f"the new model (e.g. {', '.join(missing[:3])}): they cannot be loaded, and no flag allows it")


def choose_checkpoint(ckpt_root: Path, which: str | None = None) -> tuple[Path, tuple[Path, ...]]:
    """The checkpoint a resume loads and the complete checkpoints newer than it.

    ``which``: None (the latest complete one), a step (``120``), or a checkpoint directory
    (``step_00000120`` under ``ckpt_root``, or a path). Raises RefusedError when there is no complete
    checkpoint, UsageError when ``which`` names none (the hint lists the complete ones).
    """
    from ..checkpoints import is_complete, list_checkpoints, step_dir_name
    from ..checkpoints.listing import checkpoint_step

    root = Path(ckpt_root)
    complete = list_checkpoints(root)
    if not complete:
        raise RefusedError(f"run {root.parent.name} has no complete checkpoint to resume from",
                           hint="start it again with `v4launch run` or relaunch: the job starts from step 0")
    if which is None:
        return complete[-1], ()
    forms = "a step (e.g. 120) or a complete checkpoint directory: " + ", ".join(p.name for p in complete)
    which = which.strip()
    if not which:
        raise UsageError("--checkpoint is empty", hint=f"give {forms}")
    if which.isdigit():
        path = root / step_dir_name(int(which))
    else:
        path = Path(which) if ("/" in which or Path(which).exists()) else root / which  # a bare name: this run's
    if path.name.startswith(SET_ASIDE_PREFIX):
        raise UsageError(f"--checkpoint {which}: {path.name} was set aside by an earlier rollback",
                         hint=f"rename it back to {path.name.removeprefix(SET_ASIDE_PREFIX).split('-')[0]} to use it, "
                              f"or give {forms}")
    if not is_complete(path):
        raise UsageError(f"--checkpoint {which}: {path} is not a complete checkpoint of this run",
                         hint=f"give {forms}")
    path = path.resolve()
    if path.parent != root.resolve():
        raise UsageError(f"--checkpoint {which}: {path} is not under this run's checkpoints ({root})",
                         hint=f"give {forms}")
    return path, tuple(p for p in complete if checkpoint_step(p) > checkpoint_step(path))


def set_aside(newer: tuple[Path, ...]) -> list[Path]:
    """Rename checkpoints a rollback leaves behind to ``abandoned-<name>[-k]`` (never a ``step_*`` name,
    so no later resume or ``status`` takes them for the latest); returns the new paths."""
    moved = []
    for p in newer:
        dest, k = p.with_name(f"{SET_ASIDE_PREFIX}{p.name}"), 1
        while dest.exists():
            dest, k = p.with_name(f"{SET_ASIDE_PREFIX}{p.name}-{k}"), k + 1
        p.rename(dest)
        moved.append(dest)
    return moved


def plan_resume(run_dir: Path, loaded: Any, *, stage: str | None = None, phase: str | None = None,
                allow: tuple[str, ...] = (), checkpoint: str | None = None, launcher: str = "local") -> ResumePlan:
    """Check a resume of ``run_dir`` with recipe ``loaded`` (the frozen one or a new one), from its
    latest complete checkpoint or the one ``checkpoint`` names (:func:`choose_checkpoint`; the
    newer ones are listed in ``ResumePlan.newer``). ``launcher``: the run's (``local`` | ``slurm``).

    Raises:
        RefusedError: the run has no complete checkpoint.
        UsageError: an unknown stage / phase, or ``checkpoint`` names no complete checkpoint of the run.
        DataError: a changed ``data:`` section names inputs that cannot be read.
    """
    from ..checkpoints import Manifest, check_resume
    from ..checkpoints.base import recipe_fields, recipe_hash
    from ..checkpoints.compat import CompatReport, schedule_changes
    from ..data.tokenizer import get_tokenizer
    from ..rundir import RunPaths, recipe_on_record

    ckpt, newer = choose_checkpoint(RunPaths(Path(run_dir)).checkpoints, checkpoint)
    manifest = Manifest.read(ckpt)
    recipe = loaded.recipe
    idx, explicit = target_stage(recipe, manifest, stage=stage, phase=phase)
    target_phase = recipe.curriculum.stages[idx].phase
    world = recipe.cluster.world_size
    from .plan import plan_curriculum

    target = plan_curriculum(recipe, world)[idx]  # the target stage's dp x cp (refuses what the job cannot run)
    groups = param_groups_for(recipe, target_phase, manifest, recipe_hash(recipe) == manifest.recipe_hash)
    old = dict(manifest.recipe) or recipe_on_record(Path(run_dir), manifest.recipe_hash)
    tokenizer = get_tokenizer(recipe.data.tokenizer)
    try:
        report = check_resume(manifest, recipe=recipe, target_stage_index=idx, target_phase=target_phase,
                              parallel_sizes={"world": world, "dp": target.dp, "cp": target.cp, "pp": target.pp,
                                              "tp": 1, "ep": recipe.parallel.ep},
                              tokenizer_fingerprint=tokenizer.fingerprint(),
                              param_groups=groups, allow=set(allow), checkpoint_recipe=old)
    except ValueError as exc:
        raise UsageError(str(exc), hint="see `v4launch resume --help`") from None
    data_changed = old is not None and _prepared_data(old.get("data")) != _prepared_data(recipe_fields(recipe)["data"])
    if data_changed:
        from ..data.prepare import cache_key

        cache_key(recipe.data, tokenizer)  # new inputs that do not exist: refused now, not in the job
    if schedule_changes(manifest, recipe):  # else the model's tensors are the checkpoint's by construction
        report = CompatReport((*report.items, tensors_item(recipe, manifest, ckpt)))
    report = CompatReport((*report.items, lr_item(recipe, manifest, idx, world)))
    if old is not None:
        fields = field_items(old, recipe, report.items, launcher=launcher, step=manifest.step,
                             target_stage=idx, run_dir=Path(run_dir))
        report = CompatReport((*report.items, *fields))
    return ResumePlan(run_dir=Path(run_dir), checkpoint=ckpt, manifest=manifest, stage_index=idx,
                      stage_name=recipe.curriculum.stages[idx].name, phase=target_phase, explicit_stage=explicit,
                      report=report, allow=tuple(allow), newer=newer, data_changed=data_changed)


def lr_item(recipe: Any, manifest: Any, target: int, world: int) -> Any:
    """``CompatItem("lr schedule")``: where the learning-rate schedule resumes (its global step and the AdamW lr
    there, from the resume's recipe) against where the checkpoint left it. The job continues mid-stage only in the
    checkpoint's own stage; a resume at another stage starts that stage, and the schedule jumps to its first step.
    ``safe`` when the position and its lr are unchanged; ``applied`` with both positions and values for a jump;
    at an unchanged position whose lr the new recipe's schedule moves by more than 1% from the one the checkpoint
    recorded (``manifest.extra["next_lr"]``; e.g. a finished stage made longer stretches the cosine back up),
    ``warning`` when it rises and ``applied`` when it falls."""
    from ..checkpoints.compat import CompatItem
    from .plan import LRSchedule, plan_curriculum

    plans = plan_curriculum(recipe, world)
    schedule = LRSchedule(recipe.optimizer, plans)
    m = min(manifest.stage_index, len(plans) - 1)
    was = plans[m].first_step + min(int(manifest.extra.get("step_in_stage", 0)), plans[m].steps)
    now = was if target == m or was == plans[target].first_step else plans[target].first_step
    where = f"step {now} of {schedule.total}, lr {schedule.lr(now)[0]:.3g}"
    if now == was:
        saved = manifest.extra.get("next_lr")  # the lr the checkpoint's own recipe gives there (older saves: none)
        new = schedule.lr(now)[0]
        if saved and abs(new - saved) > 0.01 * saved:
            how = "raises" if new > saved else "lowers"
            return CompatItem("lr schedule", "warning" if new > saved else "applied",
                              f"continues at {where}, but the checkpoint's recipe had lr {saved:.3g} there: this "
                              f"recipe's schedule {how} it x{new / saved:.2f} (a longer or shorter curriculum stretches "
                              "the cosine)")
        return CompatItem("lr schedule", "safe", f"continues at {where}")
    return CompatItem("lr schedule", "applied", f"jumps from step {was} (lr {schedule.lr(was)[0]:.3g}, where the "
                      f"checkpoint left it) to {where}: the start of stage {plans[target].name}; the run's optimizer "
                      f"step count continues from {manifest.step}")


def refusal(plan: ResumePlan) -> RefusedError:
    """The error for a refused report: every refused aspect with the flag that would allow it."""
    lines = [f"{i.aspect}: {i.reason}" + (f" (override: {i.override})" if i.override else " (no override)")
             for i in plan.report.refused]
    flags = sorted({i.override for i in plan.report.refused if i.override})
    lines = list(dict.fromkeys(lines))
    blocked = [i.aspect for i in plan.report.refused if not i.override]
    if blocked:  # no flag lifts these: naming the flags of the others would only lead to a second refusal
        hint = (f"{', '.join(dict.fromkeys(blocked))}: no flag allows this, so these changes cannot be resumed; "
                "start a new run with `v4launch run`")
    else:
        hint = "if you accept the consequences, add " + " ".join(flags)
    return RefusedError(f"resume of {plan.run_dir.name} from {plan.checkpoint.name} refused:\n  " + "\n  ".join(lines),
                        hint=hint)


# ---------------------------------------------------------------- field by field
_DECIDED_BY: tuple[tuple[tuple[str, ...], str], ...] = (
    (("model.n_layers", "model.compress_ratios", "model.mtp.depth"), "layer schedule"),
    (("optimizer.name", "precision.keep_fp32_params", "precision.policy."), "optimizer groups"),
    (("data.tokenizer",), "tokenizer"),
    (("cluster.nodes", "cluster.gpus_per_node", "parallel.tp", "parallel.pp", "parallel.vpp", "parallel.ep",
      "parallel.pp_layout", "parallel.cp"), "parallel."),
)
"""Fields whose verdict is the verdict of an aspect ``check_resume`` already decided."""

STORAGE_FIELDS = ("precision.params_dtype", "precision.store_param_remainders", "precision.exp_avg_dtype",
                  "precision.exp_avg_sq_dtype")
"""Storage fields: the weights and optimizer state a checkpoint holds are laid out by them (a bf16 weight's master
lives in its optimizer state), so a resume keeps them."""

_RANK = {"refused": 4, "reshard": 3, "warning": 2, "applied": 1, "safe": 0}


def _decided_by(path: str) -> str | None:
    from ..checkpoints.compat import SHAPE_FIELDS

    if path.startswith("model.") and path.removeprefix("model.") in SHAPE_FIELDS:
        return "architecture"
    return next((aspect for names, aspect in _DECIDED_BY
                 if any(path == n or (n.endswith(".") and path.startswith(n)) for n in names)), None)


def _prepared_data(section: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``data:`` fields the prepared dataset depends on: all but ``packing``, which only changes how the
    loader fills rows (a checkpoint from before the field existed has none)."""
    return None if section is None else {k: v for k, v in section.items() if k != "packing"}


def _data_meaning(path: str, new: Any, step: int) -> str:
    if path == "data.packing":
        return (f"from step {step} training rows are packed as {new}; the loader continues from the first token not "
                "yet consumed (nothing is skipped or repeated), and the dataset is not prepared again")
    if path == "data.seed":
        return (f"from step {step} the loader starts a fresh pass over the data in the order of data.seed={new}: "
                "the data order changes, the rest of the current pass is not read and documents seen before may "
                "come again")
    return (f"from step {step} the dataset is prepared again from the new data: section and the loader starts a "
            "fresh pass over it: the data order changes and documents seen before may come again")


def _meaning(path: str, new: Any, ctx: dict[str, Any]) -> tuple[str, str, str | None]:
    """(verdict, what taking the new value means, override flag) of a field no aspect decides."""
    step, launcher = ctx["step"], ctx["launcher"]
    if path.startswith("data."):
        return "applied", _data_meaning(path, new, step), None
    if path == "run.output_root":
        return "refused", (f"an existing run stays in {ctx['run_dir']}: run.output_root only places new runs "
                           "(revert it, or start a new run)"), None
    if path.startswith("slurm.") and launcher != "slurm":
        return "refused", ("a local run never reads the slurm: section (it applies to runs started with "
                           "`v4launch submit`): revert it"), None
    if path.startswith("slurm."):
        return "applied", "used by the next Slurm job this run submits (the relaunch and later stages)", None
    if path in STORAGE_FIELDS:
        return "refused", (f"the checkpoint's optimizer state is stored as the run's {path} set it (master weights, "
                           "moments); a resume keeps the storage options: revert it, or start a new run"), None
    if path == "run.seed":
        return "applied", (f"each stage started from here seeds its RNG from run.seed={new}; parameters keep their "
                           "trained values (their initialisation is not redone)"), None
    if path.startswith(("logging.", "checkpointing.")) or path in ("name", "description", "run.threads",
                                                                   "run.gc_interval_steps"):
        return "safe", f"bookkeeping only: used from step {step} (the training math is unchanged)", None
    if path.startswith("compile."):
        return "applied", (f"from step {step} the job compiles the blocks as the new compile: section says (or runs "
                           "them eagerly): the same math, in other kernels (the last bits of rounding may differ)"), None
    if path.startswith("optimizer."):
        return "applied", f"the optimizer and LR schedule use it from step {step}; saved optimizer state is kept", None
    return "applied", f"the job trains with it from step {step}", None


def _stage_field(path: str, ctx: dict[str, Any]) -> tuple[str, str, str | None] | None:
    """A field of a curriculum stage the resume continues before (it never runs again): refused."""
    parts = path.split(".")
    if len(parts) < 3 or parts[:2] != ["curriculum", "stages"] or not parts[2].isdigit():
        return None
    k = int(parts[2])
    if k >= ctx["target_stage"]:
        return None
    return "refused", (f"stage #{k} is finished before the stage the resume continues in (#{ctx['target_stage']}): "
                       "the change would never take effect and would shift the LR schedule; revert it, or resume "
                       f"at that stage (`--stage {k}`)"), None


def field_items(old: Any, recipe: Any, aspects: Any, *, launcher: str, step: int, target_stage: int,
                run_dir: Path) -> list[Any]:
    """One ``CompatItem`` per recipe field that differs between the checkpoint's recipe and ``recipe``.

    Args:
        old: the checkpoint's recipe as ``recipe_fields`` (``Manifest.recipe``).
        recipe: the resolved recipe of the resume.
        aspects: the items ``check_resume`` produced; a field they decide (layer schedule, shapes,
            optimizer groups, tokenizer, parallel sizes) takes the verdict of its aspect.
        launcher: the run's launcher (a local run never reads ``slurm:``).
        step: the checkpoint's global step (where the new values take effect).
        target_stage: the stage index the resume continues in.

    Returns:
        Items named by the dotted field path (``data.seed``), reason ``old → new: meaning``; the
        verdict is ``safe``, ``applied``, ``reshard`` or ``refused`` (with its flag, if any).
    """
    from ..checkpoints.base import recipe_fields
    from ..checkpoints.compat import CompatItem, changed_fields

    ctx = {"step": step, "launcher": launcher, "target_stage": target_stage, "run_dir": run_dir}
    out = []
    named = {i.aspect for i in aspects}
    for path, a, b in changed_fields(old, recipe_fields(recipe)):
        if path in named:  # the aspect of the same name (parallel.ep, parallel.pp) already reports it
            continue
        what = f"{as_written(a)} → {as_written(b)}"
        aspect = _decided_by(path)
        decided = [i for i in aspects if aspect and (i.aspect == aspect or i.aspect.startswith(aspect))]
        staged = _stage_field(path, ctx)
        if staged is not None:
            verdict, meaning, flag = staged
            out.append(CompatItem(path, verdict, f"{what}: {meaning}", flag))
        elif decided:
            worst = max(decided, key=lambda i: _RANK[i.verdict])
            if worst.verdict == "safe" and not worst.overridden:
                out.append(CompatItem(path, "applied", f"{what}: the job trains with it from step {step} "
                                                       f"({worst.aspect}: {worst.reason})"))
            else:
                out.append(CompatItem(path, worst.verdict, f"{what}: see {worst.aspect} ({worst.reason})",
                                      worst.override, worst.overridden))
        else:
            verdict, meaning, flag = _meaning(path, b, ctx)
            out.append(CompatItem(path, verdict, f"{what}: {meaning}", flag))
    return out
