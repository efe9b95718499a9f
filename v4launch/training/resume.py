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
5. on success resume.json records the checkpoint, the target stage and the flags; the job honours
   it once on its next start (it is renamed resume.done.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..checkpoints.listing import SET_ASIDE_PREFIX
from ..errors import RefusedError, UsageError


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
    (no memory; about a minute for full V4-Flash).
    """
    model_phase = manifest.extra.get("model_phase", manifest.phase)
    if same_recipe and phase == model_phase:
        return dict(manifest.param_groups)
    import torch

    from ..checkpoints.base import describe_params
    from ..model import V4Model
    from .model_adapter import model_args_from_recipe
    from .optim import group_kind

    with torch.device("meta"):
        model = V4Model(model_args_from_recipe(recipe), phase=phase)
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        tag = "indexer" if ".indexer." in name else "base"
        groups.setdefault(f"{group_kind(name, p, recipe.optimizer.name)}/{tag}", []).append((name, p))
    return {g: describe_params(named) for g, named in groups.items()}


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
                allow: tuple[str, ...] = (), checkpoint: str | None = None) -> ResumePlan:
    """Check a resume of ``run_dir`` with recipe ``loaded`` (the frozen one or a new one), from its
    latest complete checkpoint or the one ``checkpoint`` names (:func:`choose_checkpoint`; the
    newer ones are listed in ``ResumePlan.newer``).

    Raises:
        RefusedError: the run has no complete checkpoint.
        UsageError: an unknown stage / phase, or ``checkpoint`` names no complete checkpoint of the run.
    """
    from ..checkpoints import Manifest, check_resume
    from ..checkpoints.base import recipe_hash
    from ..data.tokenizer import get_tokenizer
    from ..rundir import RunPaths

    ckpt, newer = choose_checkpoint(RunPaths(Path(run_dir)).checkpoints, checkpoint)
    manifest = Manifest.read(ckpt)
    recipe = loaded.recipe
    idx, explicit = target_stage(recipe, manifest, stage=stage, phase=phase)
    target_phase = recipe.curriculum.stages[idx].phase
    world = recipe.cluster.world_size
    from .plan import plan_curriculum

    target = plan_curriculum(recipe, world)[idx]  # the target stage's dp x cp (refuses what the job cannot run)
    groups = param_groups_for(recipe, target_phase, manifest, recipe_hash(recipe) == manifest.recipe_hash)
    try:
        report = check_resume(manifest, recipe=recipe, target_stage_index=idx, target_phase=target_phase,
                              parallel_sizes={"world": world, "dp": target.dp, "cp": target.cp, "pp": target.pp,
                                              "tp": 1, "ep": 1},
                              tokenizer_fingerprint=get_tokenizer(recipe.data.tokenizer).fingerprint(),
                              param_groups=groups, allow=set(allow))
    except ValueError as exc:
        raise UsageError(str(exc), hint="see `v4launch resume --help`") from None
    return ResumePlan(run_dir=Path(run_dir), checkpoint=ckpt, manifest=manifest, stage_index=idx,
                      stage_name=recipe.curriculum.stages[idx].name, phase=target_phase, explicit_stage=explicit,
                      report=report, allow=tuple(allow), newer=newer)


def refusal(plan: ResumePlan) -> RefusedError:
    """The error for a refused report: every refused aspect with the flag that would allow it."""
    lines = [f"{i.aspect}: {i.reason}" + (f" (override: {i.override})" if i.override else " (no override)")
             for i in plan.report.refused]
    flags = sorted({i.override for i in plan.report.refused if i.override})
    hint = ("if you accept the consequences, add " + " ".join(flags)) if flags else \
        "these changes cannot be resumed; start a new run with `v4launch run`"
    return RefusedError(f"resume of {plan.run_dir.name} from {plan.checkpoint.name} refused:\n  " + "\n  ".join(lines),
                        hint=hint)
