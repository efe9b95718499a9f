"""The job's state machine: model + optimizers + data + checkpoints, driven stage by stage by job.py."""

from __future__ import annotations

import math
import os
import pickle
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..checkpoints.base import CheckpointError, Manifest, csa_layer_ids
from ..checkpoints.dcp import latest_checkpoint, load_checkpoint, save_checkpoint
from ..checkpoints.stateful import ModelState, OptimizerState
from ..data.resume_state import loader_state_for_resume
from ..errors import ContractViolation, RefusedError, TrainingDiverged, UsageError
from ..model import V4Model
from ..model.common import device_mark
from ..model.compile import toolchain_problem
from ..model.parallel.parallelize import ParallelDims, ParallelGroups, ParallelModel, parallelize
from ..validators.derived import boundary_width
from .data_io import eval_batches, micro_batches, newest_epoch, stage_loader
from .dist import DistInfo, Groups, Layout, any_rank, describe_layout, gather_objects
from ..plot import stage_end_plot
from .gc_schedule import GarbageCollection
from .graph_step import CapturedStep, stage_graph_plan
from .manifest_tables import param_group_tables
from .metrics import memory_gib
from .model_adapter import model_args_from_recipe
from .master_weights import storage_for
from .optim import Optimizers
from .plan import LRSchedule, StagePlan, plan_curriculum, recompute_names
from .released_init import load_released_init
from .result import TrainResult
from .step_profile import StepProfiler
from .state import (Progress, progress_from, progress_state, rng_state, seed_everything, set_determinism,
                    set_rng_state, stage_seed)
from .step import PendingStats, autocast_for, evaluate, loss_weights, queue_step


def refuse_missing_toolchain(backend: str | None, device: torch.device) -> None:
    """Stop before any training when ``compile.backend`` cannot generate code on ``device`` (inductor on a
    CPU without a C++ compiler: ``model.compile.toolchain_problem``). ``backend`` None: nothing is compiled.

    Raises:
        UsageError: with the field, the reason and the fix.
    """
    problem = None if backend is None else toolchain_problem(backend, device)
    if problem is not None:
        cxx = os.environ.get("CXX")
        raise UsageError(f"compile.backend = {backend} on {device.type}: {problem}",
                         hint="fix: compile.backend=aot_eager (checks the tracing, no speed-up), or "
                              "compile.enable=false, or " + (f"point $CXX (now {cxx!r}) at a C++ compiler" if cxx
                                                            else "install g++ (or point $CXX at a C++ compiler)"))


def refuse_missing_gpus(gpu: str, gpu_index: int, cuda_devices: int) -> None:
    """Stop before anything is prepared when a recipe sized for GPUs (``cluster.gpu`` not ``cpu``) would run
    here without one: on a machine without CUDA the job would train the model on the CPU (a bench-sized step
    takes minutes there, and the memory plan was made for the GPU), and a rank whose GPU index is not on this
    machine fails inside CUDA with "invalid device ordinal".

    Args:
        gpu: ``cluster.gpu`` of the recipe.
        gpu_index: the highest GPU index a process on this machine will use (local rank; the local launcher's
            last rank is nodes x gpus_per_node - 1).
        cuda_devices: ``torch.cuda.device_count()`` here.
    Raises:
        UsageError: naming cluster.gpu or cluster.gpus_per_node, what this machine has, and the fix.
    """
    if gpu == "cpu":
        return
    if cuda_devices == 0:
        raise UsageError(f"cluster.gpu = {gpu}: the recipe is sized for {gpu} GPUs, but this machine has no CUDA "
                         "GPU (torch.cuda.is_available() is False): the job would train the model on the CPU",
                         hint="fix: run it where the GPUs are (`v4launch submit` on the cluster), or set "
                              "cluster.gpu=cpu with a model and batch a CPU can train (recipes/tiny_cpu.yaml)")
    if gpu_index >= cuda_devices:
        raise UsageError(f"cluster.gpus_per_node: a process here would use GPU {gpu_index}, but this machine has "
                         f"{cuda_devices} (one process per GPU)",
                         hint=f"fix: cluster.nodes=1 cluster.gpus_per_node={cuda_devices} for a run on this "
                              "machine (validate then checks the batch and layout), or `v4launch submit` it")


class Runner:
    """Everything one rank holds while training a run. Built ready to continue where the run is."""

    def __init__(self, run: Any, info: DistInfo, dataset: Any, request: dict | None) -> None:
        self.run, self.recipe, self.info, self.dataset = run, run.recipe, info, dataset
        set_determinism(self.recipe.run.deterministic, self.recipe.run.threads)
        self.plans: list[StagePlan] = plan_curriculum(self.recipe, info.world)
        par = self.recipe.parallel
        self.dims = ParallelDims(pp=par.pp, vpp=par.vpp, pp_layout=par.pp_layout, ep=par.ep,
                                 distributed_optimizer=par.distributed_optimizer,
                                 recompute=tuple(recompute_names(self.recipe)),
                                 compile_backend=self.recipe.compile.backend if self.recipe.compile.enable else None,
                                 params_dtype=self.recipe.precision.params_dtype, cpu_offloading=par.cpu_offloading)
        refuse_missing_toolchain(self.dims.compile_backend, info.device)  # again on the node that runs it
        self.groups = Groups(info, {p.cp for p in self.plans}, pp=par.pp, ep=par.ep)  # collective: every rank, same order
        self.layout: Layout = self.groups.layout(self.plans[0].cp)
        self.schedule = LRSchedule(self.recipe.optimizer, self.plans)
        self.args = model_args_from_recipe(self.recipe)
        self.boundary = boundary_width(self.args.window_size, self.args.compress_ratios)
        self.autocast = autocast_for(self.recipe.precision.dtype, info.device)
        self.ckpt_root = run.paths.checkpoints
        self.profiler = StepProfiler(run.paths.root / "profile", info.rank)  # V4LAUNCH_PROFILE_STEPS, off by default
        self.gc = GarbageCollection(self.recipe.run.gc_interval_steps)  # collections between timed steps only
        self.metrics: Any = None
        self.loader = self.batches = None
        self._saved_loader: dict | None = None
        self.data_note: str | None = None  # set when a resume rebuilt the loader state for new data
        self.loader_stage = -1
        self.last_saved: tuple[int, Path] | None = None
        self.resumed_from: Path | None = None
        self.saved_layout: tuple[int, int, int, int] | None = None  # (dp, cp, pp, ep) of the loaded checkpoint
        self.pm: ParallelModel | None = None
        self.captured: CapturedStep | None = None  # compile.cuda_graph: the stage's captured step
        # the step queued, not read yet: (stats, record, host start, device start mark or None, shown?)
        self._pending: tuple[PendingStats, dict[str, Any], float, Any, bool] | None = None
        self._last_read = 0.0  # time.monotonic() when the last step read had ended (QueuedRead.ready_at)
        self.progress = Progress(phase=self.plans[0].phase)
        ckpt = self._checkpoint_to_load(request)
        self.init_note: str | None = None  # what model.init_from_released loaded (logged at start)
        if ckpt is None:
            seed_everything(self.recipe.run.seed)
            self._build(self.plans[0].phase)
            if self.recipe.model.init_from_released:  # released weights imported by `v4launch checkpoint import`
                self.init_note = load_released_init(self.model, self.recipe.model.init_from_released)
        else:
            self._load(ckpt)
            self._apply_request(request)
        self.first_step = self.progress.step

    @property
    def total_steps(self) -> int:
        return self.plans[-1].end_step

    # ------------------------------------------------------------ build / load
    def _build(self, phase: str, *, build_phase: str | None = None, tags: tuple[str, ...] = ("base", "indexer")) -> None:
        """The single-device model (same seed on every rank), cut to this rank's part of the layout.

        ``build_phase``: build the model in this phase and let the seam move it to ``phase`` before
        sharding (a sharded model's phase change); ``tags``: the optimizer's parameter tags."""
        chunk = self.recipe.attention.kl_chunk_size
        devices = [self.info.device] if self.info.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=build_phase is not None):  # a rebuild draws nothing
            full = V4Model(self.args, phase=build_phase or phase, chunk_size=chunk,
                           cp=self.layout.hooks).to(self.info.device)
        groups = ParallelGroups(pp_rank=self.groups.pp_rank, pipeline=self.groups.pipe_group,
                                shard=self.groups.shard_group, ep_rank=self.groups.ep_rank, ep=self.groups.ep_group,
                                dp=self.layout.dp)
        try:
            self.pm = parallelize(full, self.dims, groups, self.info.device, cp=self.layout.hooks, phase=phase,
                                  precision=self.recipe.precision)
        except (ValueError, NotImplementedError) as exc:
            raise ContractViolation(str(exc).split(" Fix: ")[0], hint=str(exc).partition(" Fix: ")[2] or
                                    "check `v4launch validate`") from None
        self.model = self.pm.model  # this rank's parameters under their single-device names
        self.opt = Optimizers(self.model, self.recipe.optimizer, tags=tags,
                              storage=storage_for(self.recipe.precision))
        self.progress.phase = phase

    def _checkpoint_to_load(self, request: dict | None) -> Path | None:
        if request and request.get("checkpoint"):
            path = Path(request["checkpoint"])
            if not path.is_dir():
                raise RefusedError(f"resume.json names checkpoint {path}, which does not exist",
                                   hint=f"run `v4launch resume {self.run.paths.root}` again")
            return path
        return latest_checkpoint(self.ckpt_root)

    def _states(self) -> dict[str, Any]:
        loader_state = pickle.dumps(self.loader.state_dict()) if self.loader is not None else b""
        return {"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.opt.optimizers),
                "dataloader": {"state": loader_state, "stage_index": self.loader_stage},
                "lr_scheduler": {"schedule_step": self.schedule_step},
                "curriculum": progress_state(self.progress), "train_state": {"rng": rng_state()}}

    @property
    def schedule_step(self) -> int:
        """Position in the LR schedule: the stage's first step + steps done in it."""
        plans = self.plans
        idx = min(self.progress.stage_index, len(plans) - 1)
        return plans[idx].first_step + self.progress.step_in_stage

    def _load(self, path: Path) -> None:
        """Build the model in the checkpoint's phase, then load every state key into it."""
        try:
            manifest = Manifest.read(path)
        except CheckpointError as exc:
            raise RefusedError(exc.message, exc.hint) from None
        self._build(manifest.model_phase)
        states = self._states()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                load_checkpoint(path, states)
        except CheckpointError as exc:
            raise RefusedError(exc.message, exc.hint) from None
        except RuntimeError as exc:
            raise RefusedError(f"checkpoint {path} does not load into the model of this recipe: {exc}",
                               hint="check the resume report (`v4launch resume --dry-run`)") from None
        self.progress = progress_from(states["curriculum"])
        set_rng_state(states["train_state"]["rng"])
        blob = states["dataloader"]["state"]
        self._saved_loader = pickle.loads(blob) if blob else None
        self._saved_loader, self.data_note = loader_state_for_resume(  # a resume that changed the data: section
            self._saved_loader, manifest=manifest, recipe=self.recipe, dataset=self.dataset, run_dir=self.run.paths.root)
        self.resumed_from = path
        par = manifest.parallel
        self.saved_layout = (par["dp"], par["cp"], par.get("pp", 1), par.get("ep", 1)) if "dp" in par and "cp" in par \
            else None
        self.last_saved = (self.progress.step, path)

    def _apply_request(self, request: dict | None) -> None:
        """Honour ``resume.json``'s target stage: start it from its beginning."""
        target = (request or {}).get("stage_index")
        if target is None or target == self.progress.stage_index:
            return
        self.progress.stage_index, self.progress.step_in_stage = int(target), 0

    # ------------------------------------------------------------ stages
    def announce_start(self) -> None:
        p = self.progress
        where = f"resumed from {self.resumed_from.name}" if self.resumed_from else "fresh start"
        plan = self.plans[min(p.stage_index, len(self.plans) - 1)]
        self.metrics.event(p.step, "start", f"run {self.run.paths.root.name}: {where} at step {p.step}, stage "
                           f"{plan.name}, phase {p.phase}, world {self.info.world} ({describe_layout(plan.dp, plan.cp, plan.pp)}"
                           f"{self._ep_fsdp_text()})",
                           resumed_from=str(self.resumed_from or ""))
        if self.data_note:
            self.metrics.event(p.step, "data", self.data_note)
        self.metrics.event(p.step, "gc", self.gc.describe(), interval_steps=self.gc.interval_steps)
        if self.init_note:
            self.metrics.event(p.step, "init", self.init_note)
        if self.recipe.precision.fp8_recipe != "none":  # which GEMM runs at which precision, and why
            from ..model.parallel.precision import describe_precision, fp8_module_filter

            self.metrics.event(p.step, "precision", describe_precision(self.model, fp8_module_filter(self.recipe.precision)),
                               fp8_modules=len(self.pm.fp8_modules))
        if self.pm.recomputed:
            from ..validators.recompute_policy import replayed_collectives

            replays = replayed_collectives(self.dims.recompute, max_cp=max(st.cp for st in self.plans), ep=self.dims.ep)
            self.metrics.event(p.step, "recompute", f"recompute {', '.join(self.dims.recompute)}: "
                               f"{len(self.pm.recomputed)} regions re-run in backward"
                               + (f", replaying {'; '.join(replays)}" if replays else ""), regions=len(self.pm.recomputed))
        self._announce_storage(p.step)
        if self.pm.compiled:
            self.metrics.event(p.step, "compile", f"torch.compile ({self.dims.compile_backend}): {self.pm.compiled} "
                               "blocks, compiled at their first forward (again after a phase or kernel change)",
                               blocks=self.pm.compiled, backend=self.dims.compile_backend)

    def _announce_storage(self, step: int) -> None:
        """The ``storage`` and ``offload`` events: which weights are bf16 over which master, the moments' dtypes,
        and which layers' inputs go to host memory (and that a CPU run keeps them where they are)."""
        pr = self.recipe.precision
        if self.pm.low_precision or pr.exp_avg_dtype != "fp32" or pr.exp_avg_sq_dtype != "fp32":
            master = "16-bit remainders" if pr.store_param_remainders else "an fp32 copy"
            self.metrics.event(step, "storage", f"storage: {len(self.pm.low_precision)} GEMM weights in bf16 over an "
                               f"exact fp32 master kept as {master}, bf16 gradients; moments exp_avg "
                               f"{pr.exp_avg_dtype}, exp_avg_sq {pr.exp_avg_sq_dtype}",
                               bf16_weights=len(self.pm.low_precision))
        if self.pm.offloaded:
            where = ("to pinned host memory, prefetched ahead of backward" if self.info.device.type == "cuda"
                     else "nowhere: on the CPU the inputs already are in host memory, so they stay where they are")
            self.metrics.event(step, "offload", f"activation offload: the inputs of {len(self.pm.offloaded)} "
                               f"recomputed layers go {where}", layers=len(self.pm.offloaded))

    def enter_stage(self, plan: StagePlan) -> None:
        """Phase change (if the stage needs one), the stage's rank layout, stage seed at its start, its data loader."""
        if self.model.phase != plan.phase:
            self._change_phase(plan.phase)
        self._set_layout(plan)
        self._set_kernels(plan)
        if self.progress.step_in_stage == 0:
            seed_everything(stage_seed(self.recipe.run.seed, plan.index))
        previous = self.loader.state_dict() if self.loader is not None else self._saved_loader
        self.loader = stage_loader(self.dataset, self.recipe, plan, self.layout)
        if previous is not None:
            self.loader.load_state_dict(previous)
        self._saved_loader = None
        self.loader_stage = plan.index
        self.batches = iter(self.loader)
        self._set_graph(plan)

    def _set_graph(self, plan: StagePlan) -> None:
        """``compile.cuda_graph``: a fresh captured step for the stage (captured at its first micro-batch), or
        none where the stage reads the host inside its step; the log says which and why."""
        if self.captured is not None:  # the previous stage's graph (its phase, kernels, shapes) goes, with the
            self.captured.release()  # gradients it owns: the next stage's first backward starts from none
        self.captured = None
        use, text = stage_graph_plan(self.recipe, plan, self.model.kernels_for(self.info.device).name,
                                     self.info.device)
        if use:
            self.captured = CapturedStep(self.model, seq_len=plan.seq_len, accum=plan.accum, autocast=self.autocast,
                                         report=self.run.paths.root / f"cuda_graph_capture_rank{self.info.rank}.txt")
        if text:
            self.metrics.event(self.progress.step, "cuda_graph", text, captured=use)

    def _set_layout(self, plan: StagePlan) -> None:
        """The stage's ``[dp][cp]`` layout; the model gets the stage's CP hooks (same parameters). The
        ``layout`` event compares with the layout the run last trained at: the previous stage's, or on
        the first stage after a resume the one the checkpoint was written at."""
        old = self.layout
        self.layout = self.groups.layout(plan.cp)
        self.pm.set_cp(self.layout.hooks, dp=self.layout.dp)
        new = (self.layout.dp, self.layout.cp, self.layout.pp, self.layout.ep)
        after_resume = self.loader is None and self.saved_layout is not None
        before = self.saved_layout if after_resume else (old.dp, old.cp, old.pp, old.ep)
        if before != new:
            step = self.progress.step
            was = describe_layout(*before) + (f" (checkpoint {self.resumed_from.name})" if after_resume else "")
            self.metrics.event(step, "layout", f"stage {plan.name}: {was} -> {self.layout.describe()} "
                               f"at step {step} (this rank: dp rank {self.layout.dp_rank}, cp rank "
                               f"{self.layout.cp_rank}{self._pp_rank_text()})", dp=self.layout.dp, cp=self.layout.cp, pp=self.layout.pp,
                               ep=self.layout.ep, resharded=after_resume)

    def _ep_fsdp_text(self) -> str:
        """`` x ep 2 (experts 0-3 of 8 here), FSDP2 over 2 ranks`` for the start line ('' when neither)."""
        text = ""
        if self.dims.ep > 1:
            n = self.args.n_routed_experts // self.dims.ep
            first = self.groups.ep_rank * n
            text += f" x ep {self.dims.ep} (experts {first}-{first + n - 1} of {self.args.n_routed_experts} here)"
        if self.pm.sharded:
            text += f", FSDP2 over the {self.groups.shard_size} ranks of a pipeline rank"
        return text

    def _pp_rank_text(self) -> str:
        return f", pp rank {self.layout.pp_rank}" if self.layout.pp > 1 else ""

    def _set_kernels(self, plan: StagePlan) -> None:
        """The stage's attention kernels; the log says which backend this device actually runs and why."""
        if self.model.kernel_backend == plan.kernel_backend and self.loader is not None:
            return
        self.pm.set_kernel_backend(plan.kernel_backend)
        backend = self.model.kernels_for(self.info.device)
        self.metrics.event(self.progress.step, "kernels", f"stage {plan.name}: attention kernels "
                           f"{plan.kernel_backend} -> running {backend.name} ({backend.reason})",
                           requested=plan.kernel_backend, running=backend.name)

    def _change_phase(self, phase: str) -> None:
        old = self.model.phase
        order = ("dense", "warmup", "sparse")
        if order.index(phase) < order.index(old):
            self._regress_phase(phase)
        elif self.pm.sharded and old == "dense":
            self._rebuild_in_phase(phase)
        else:
            before = {n for n, _ in self.model.named_parameters()}
            self.pm.set_phase(phase)
            new = [(n, q) for n, q in self.model.named_parameters() if n not in before]
            if new:
                self.opt.add_params(self.model, new, "indexer")
        step = self.progress.step
        self.progress.phase = phase
        self.progress.transitions.append(f"{old}->{phase}@{step}")
        built = " (indexers built and initialised, added to the optimizer)" if old == "dense" else ""
        self.metrics.event(step, "phase", f"phase {old} -> {phase} at step {step}{built}", old=old, new=phase)

    def _rebuild_in_phase(self, phase: str) -> None:
        """dense -> warm-up on an FSDP-sharded model: FSDP's parameter groups are fixed by ``fully_shard``,
        so the model is built again (its own initialisation under a forked RNG, which it then discards),
        moved to ``phase`` by the seam before sharding (the indexers draw the RNG as an unsharded phase
        change would), and the model and optimizer state move over by FQN (DTensor to DTensor, same
        shards); the indexers join the optimizer as new groups, as without sharding."""
        model_state = ModelState(self.model).state_dict()
        opt_state = OptimizerState(self.model, self.opt.optimizers).state_dict()
        old = self.model.phase
        self.pm = self.model = self.opt = None  # the old shards go once the state dicts are the last holders
        self._build(phase, build_phase=old, tags=("base",))
        ModelState(self.model, strict=False).load_state_dict(model_state)
        OptimizerState(self.model, self.opt.optimizers).load_state_dict(opt_state)
        self.opt.add_params(self.model, [(n, q) for n, q in self.model.named_parameters() if ".indexer." in n],
                            "indexer")

    def _regress_phase(self, phase: str) -> None:
        """Allowed phase regression (``--allow-phase-regression``): new model without indexers, fresh optimizer."""
        state = {k: v for k, v in self.model.state_dict().items() if ".indexer." not in k}
        self._build(phase)
        self.model.load_state_dict(state)
        self.metrics.event(self.progress.step, "phase_regression", f"phase regressed to {phase}: indexers dropped, "
                           "optimizer state reset")

    def run_stage(self, plan: StagePlan, stop: threading.Event, max_steps: int | None) -> str | None:
        """Train the stage's remaining steps; 'stopped' / 'max_steps' when interrupted, else None."""
        p = self.progress
        while p.step_in_stage < plan.steps:
            if max_steps is not None and p.step >= max_steps:
                return "max_steps"
            self._one_step(plan)
            if p.step_in_stage >= plan.steps:
                return None
            every = self.recipe.logging.eval_interval_steps  # the stage's own count: a resume evaluates alike
            if every and p.step_in_stage % every == 0:
                self.evaluate_held_out(plan, "interval")
            if p.step % self.recipe.checkpointing.interval_steps == 0:
                self.save(plan)
            if self.stop_requested(stop):
                return "stopped"
        return None

    def _one_step(self, plan: StagePlan) -> None:
        """Queue the next step, then read and log the one before it, which the GPU has finished meanwhile.

        The step's statistics are read one step late (``step.PendingStats``): the host builds step N + 1's
        batch tables and queues its work while the GPU still runs step N, instead of waiting for step N to
        drain first. :meth:`flush_stats` reads the last one wherever the job needs the device quiet and the
        log complete: before an evaluation, a checkpoint, a profile's end and a halt."""
        sched = self.schedule_step
        lr, muon_lr = self.schedule.lr(sched)
        self.opt.set_lr(lr, muon_lr)
        weights = loss_weights(self.recipe, self.schedule.decay_started(sched))
        self.profiler.begin(self.progress.step + 1)
        t0 = time.monotonic()
        started = device_mark(self.info.device)  # where the device reaches this step's work (GPU; None on a CPU)
        batches = micro_batches(self.batches, plan, self.info.device, self.layout, self.boundary, self.args.vocab_size)
        pending = queue_step(self.model, self.opt, batches, accum=plan.accum, weights=weights,
                             grad_clip=self.recipe.optimizer.grad_clip,
                             bias_speed=self.recipe.model.moe.bias_update_speed, info=self.info,
                             autocast=self.autocast, cp=plan.cp, pipeline=self.pm.pipeline, layout=self.layout,
                             experts=self.pm.experts, sharded=self.pm.sharded, captured=self.captured)
        p = self.progress
        p.step, p.step_in_stage = p.step + 1, p.step_in_stage + 1
        rec = {"kind": "train", "stage": plan.name, "stage_index": plan.index, "phase": self.model.phase,
               "step": p.step, "step_in_stage": p.step_in_stage, "data_epoch": newest_epoch(batches), "dp": plan.dp, "cp": plan.cp, "pp": plan.pp,
               "lr": lr, "muon_lr": muon_lr,
               "loss_weights": {"indexer_kl": weights.indexer_kl, "balance": weights.balance, "mtp": weights.mtp}}
        interval = self.recipe.logging.interval_steps
        show = p.step % interval == 0 or p.step_in_stage in (1, plan.steps) or p.step == self.first_step + 1
        self.flush_stats()  # the previous step's, now that this one is queued behind it
        self._pending = (pending, rec, t0, started, show)
        self.gc.after_step(p.step)
        if self.profiler.steps is not None and p.step == self.profiler.steps[1]:
            self.flush_stats()  # the profile's last step logged before its table
        table = self.profiler.end(p.step)
        if table is not None:
            self.metrics.event(p.step, "profile", f"torch.profiler of steps {self.profiler.steps[0]}-{p.step}: {table}",
                               path=str(table))

    def flush_stats(self) -> None:
        """Read and log the queued step's statistics, if a step is queued (waits for that step on the device).

        ``step_time_s`` runs from the later of the step's start and the previous step's end to this step's end.
        On a GPU both ends are device timestamps (:func:`device_mark` recorded when the host began the step,
        which the device reaches once the work queued before it is done; the read's event after the step's
        work): with steps queued back to back it is the interval between two steps' ends on the device, where
        the host is slower, from the host's start of the step. Host clocks could not tell: a step that reads the
        host inside (the warm-up's dense KL chunk ranges) lets the device finish most of it, and the previous
        step, while the host is still queueing it, and a stage's last step, read at once, was then credited
        with its tail alone (3 ms for an 8,192-token warm-up step on an H200, 2.7 million tokens/s). On a CPU,
        where the work runs synchronously, host clocks: from the later of the step's start and the previous
        read to its values being there (``QueuedRead.ready_at``)."""
        if self._pending is None:
            return
        pending, rec, t0, started, show = self._pending
        self._pending = None
        stats = pending.result()
        done = pending.read.ready_at or time.monotonic()
        if started is not None and pending.read.event is not None:
            dt = started.elapsed_time(pending.read.event) / 1000.0
        else:
            dt = done - max(t0, self._last_read)
        self._last_read = done
        p = self.progress
        p.tokens, p.elapsed_s = p.tokens + stats.tokens, p.elapsed_s + dt
        rec.update({"tokens": p.tokens, "lm_loss": stats.lm_loss, "aux": stats.aux, "aux_sum": stats.kinds,
                    "aux_weighted": stats.weighted, "total_loss": stats.total, "grad_norm": stats.grad_norm,
                    "tokens_per_s": stats.tokens / max(dt, 1e-9), "step_time_s": dt, "elapsed_s": p.elapsed_s,
                    **memory_gib(self.info.device)})
        self.metrics.step(rec, first_step_this_job=self.first_step, show=show,
                          stage_steps=self.plans[rec["stage_index"]].steps)
        self._refuse_non_finite(rec)

    def _refuse_non_finite(self, rec: dict[str, Any]) -> None:
        """Stop the job, saving nothing, when the step's losses or gradient norm are not finite.

        Training on would write NaN weights into the next checkpoint, and ``checkpointing.keep_last`` would then
        delete the good ones. The values are means over every rank (the same on all), so every rank stops here.
        Raises:
            TrainingDiverged: names the step, the values and the newest checkpoint, which is left as it is.
        """
        values = {"lm_loss": rec["lm_loss"], "grad_norm": rec["grad_norm"], "total_loss": rec["total_loss"],
                  **{f"aux.{k}": v for k, v in rec["aux"].items()}}
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if not bad:
            return
        newest = latest_checkpoint(self.ckpt_root)
        kept = f"the newest checkpoint, {newest.name}, is from before it" if newest else "no checkpoint was saved yet"
        where = f"step {rec['step']} (stage {rec['stage']}, phase {rec['phase']}, lr {rec['lr']:.3g})"
        message = (f"{where}: " + ", ".join(f"{k} = {v}" for k, v in bad.items()) + " is not finite; the job "
                   f"stopped without saving it (its record is in metrics.jsonl) and {kept}")
        self.metrics.event(rec["step"], "diverged", message, values=bad)
        raise TrainingDiverged(message, hint="look at the steps before it in metrics.jsonl (lm_loss, grad_norm); "
                               "lower optimizer.lr, raise optimizer.warmup_steps or set optimizer.grad_clip, "
                               "then continue from that checkpoint (`v4launch resume`) or start a new run")

    def finish_stage(self, plan: StagePlan) -> None:
        """Held-out evaluation and the stage-end checkpoint."""
        self.flush_stats()
        self.gc.full()
        self.evaluate_held_out(plan, "stage_end")
        self.save(plan)
        if self.info.is_main and self.recipe.logging.plot:  # a failure is a warning, never the job's end
            stage_end_plot(self.run.paths.root, lambda text: self.metrics.event(self.progress.step, "warning", text))

    def evaluate_held_out(self, plan: StagePlan, at: str) -> None:
        """The held-out LM loss on the first held-out micro-batches (the same documents at every call:
        ``data_io.eval_batches``), forward only, as an ``eval`` record (``at``: ``interval`` after every
        ``logging.eval_interval_steps``-th step of a stage, ``stage_end``). Draws no random number and leaves
        the training state as it was (eval mode keeps no MoE expert counts), so the steps after it are those of
        a run without it; its cost: ``validators/eval_cost.py``. Collective: every rank calls it."""
        self.flush_stats()  # the step's record before the evaluation's
        batches = eval_batches(self.dataset, self.recipe, plan, self.layout, self.info.device, self.boundary)
        result = evaluate(self.model, batches, self.info, self.autocast, pipeline=self.pm.pipeline, layout=self.layout)
        self.pm.reshard()
        if result:
            self.metrics.eval({"kind": "eval", "at": at, "stage": plan.name, "stage_index": plan.index,
                               "phase": self.model.phase, "seq_len": plan.seq_len, "step": self.progress.step,
                               "step_in_stage": self.progress.step_in_stage, **result})

    def stop_requested(self, stop: threading.Event) -> bool:
        """True on every rank if a stop was requested on any rank."""
        return any_rank(stop.is_set(), self.info)

    # ------------------------------------------------------------ checkpoints
    def save(self, plan: StagePlan) -> Path:
        """Checkpoint at the current step (every rank; collective). Keeps checkpointing.keep_last."""
        self.flush_stats()  # the manifest's token count, and the step's record before the checkpoint's event
        p = self.progress
        if self.last_saved is not None and self.last_saved[0] == p.step:
            return self.last_saved[1]
        self.gc.full()
        groups, summary = param_group_tables(self.model, self.opt, gather=self.info.active and (
            self.dims.pp > 1 or self.dims.ep > 1))
        manifest = Manifest.for_recipe(
            self.recipe, stage_index=p.stage_index, step=p.step, tokens_consumed=p.tokens,
            parallel_sizes={"world": self.info.world, "dp": plan.dp, "cp": plan.cp, "pp": self.dims.pp, "tp": 1,
                            "ep": self.dims.ep},
            tokenizer_fingerprint=self.dataset.tokenizer, param_groups=groups,
            indexer_layers=csa_layer_ids(self.args.compress_ratios) if self.model.has_indexer else (),
            extra={"step_in_stage": p.step_in_stage, "model_phase": self.model.phase, "run": self.run.paths.root.name,
                   "transitions": list(p.transitions), "param_groups": summary,
                   "next_lr": self.schedule.lr(self.schedule_step)[0],
                   "vpp": self.dims.vpp, "pp_layout": self.dims.pp_layout})
        with warnings.catch_warnings():  # DCP warns that a single process saves without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            path = save_checkpoint(self.ckpt_root, p.step, self._states(), manifest,
                                   keep_last=self.recipe.checkpointing.keep_last)
        self.last_saved = (p.step, path)
        self.metrics.event(p.step, "checkpoint", f"checkpoint {path.name} saved", path=str(path))
        return path

    def _report_peak_memory(self) -> None:
        """A ``memory`` event with every rank's peak CUDA memory of this job (GiB; one gather; none on CPU)."""
        if self.info.device.type != "cuda":
            return
        peak = torch.cuda.max_memory_allocated(self.info.device) / 2**30
        peaks = gather_objects(peak, None) if self.info.active else [peak]
        self.metrics.event(self.progress.step, "memory", "peak GPU memory per rank (GiB): " +
                           " ".join(f"{x:.2f}" for x in peaks), peak_gib=peaks)

    def close_profiler(self) -> None:
        """Close a V4LAUNCH_PROFILE_STEPS window the run stops inside (a profiler left open at exit crashes the
        process) and say so; also say when the run stopped before the window."""
        note = self.profiler.close(self.progress.step)
        if note is not None and self.metrics is not None:
            self.metrics.event(self.progress.step, "profile", note)

    def halt(self, status: str, plan: StagePlan) -> TrainResult:
        """Save (unless this step is already saved) and build the result."""
        self.flush_stats()
        path = self.save(plan) if self.progress.step > 0 or self.last_saved else None
        p = self.progress
        self.close_profiler()
        self._report_peak_memory()
        self.metrics.event(p.step, "end", f"{status} at step {p.step} (stage {plan.name}, phase {self.model.phase})",
                           status=status)
        return TrainResult(status=status, stage_index=plan.index, step=p.step, checkpoint=path)
