"""Harness of the sharded-data-parallel tests: spawn gloo ranks, run FSDP and the one-process reference, compare.

Every rank builds the same seeded model and batches, runs the single-process reference (the
whole global batch, plain parameters, its own optimizer) itself, then the parallel run
(``apply_fsdp`` over the world, or unsharded with ``reduce_gradients``) on its share, and
reports max relative errors of losses, gradients (``full_tensor`` of the sharded ones) and
parameters after each optimizer step. A uniquely named module so no other conftest shadows it.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/model (v4_helpers)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "checkpoints"))  # ckpt_helpers

from v4_helpers import build, gloo_spawn, packed_batch, tiny_args  # noqa: E402

from v4launch.model.parallel import SINGLE_DEVICE, ContextParallelGroup, shard_thd_batch  # noqa: E402
from v4launch.model.parallel.data_parallel import clip_grad_norm, reduce_gradients  # noqa: E402
from v4launch.model.parallel.fsdp import apply_fsdp, routed_expert_params, set_divide_factor  # noqa: E402
from v4launch.training.optim import Optimizers  # noqa: E402
from v4launch.validators.schema import OptimizerConfig  # noqa: E402

CLIP = 1.0  # clips the first steps of the tiny model (its gradient norm starts above 1)
DTYPES = {"float64": torch.float64, "float32": torch.float32}
CP_LENGTHS = [5, 140, 60, 51]  # T = 256: L = 128 = the HCA boundary width at cp 2; one segment spans both ranks
DP_LENGTHS = ([5, 140, 60, 51], [64, 64, 64, 64])  # rank 1's segments are too short for HCA: its compressor idles
OPT = dict(name="muon_adamw", lr=1e-2, muon_lr=2e-2, weight_decay=0.1, eps=1e-6)
"""Large learning rates, so steps move the parameters a lot. AdamW eps 1e-6 (not 1e-8): AdamW's update
``lr · m / (sqrt(v) + eps)`` turns a rounding-level gradient difference δ into ``lr · δ / eps``, which with
1e-8 exceeds 1e-10 for entries whose gradient is itself near zero."""


def spawn(world: int, cases: list[dict], tmp_path) -> list[list[dict]]:
    """Run ``cases`` (each with ``kind``) on ``world`` gloo ranks; returns results[rank][case index]."""
    return gloo_spawn(world, cases, tmp_path, run_case)


def run_case(case: dict) -> dict:
    """One case on this rank (dispatched by its contents)."""
    return {"model": model_case, "load": load_case, "optim": optim_case, "errors": error_case}[case["kind"]](case)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| relative to max(1, max |b|) (a may be a DTensor: compared whole)."""
    a = a.full_tensor() if isinstance(a, DTensor) else a
    b = b.full_tensor() if isinstance(b, DTensor) else b
    if not b.numel():
        return 0.0
    return (a.detach() - b.detach()).abs().max().item() / max(1.0, b.detach().abs().max().item())


def worst(pairs) -> tuple[float, str]:
    """(max error, its name) over ``(name, a, b)``."""
    out = (0.0, "")
    for name, a, b in pairs:
        e = err(a, b)
        if e >= out[0]:
            out = (e, name)
    return out


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def total(out) -> torch.Tensor:
    return out.lm_loss + sum(out.aux_losses.values())


def _batches(args, seed: int, layout: str):
    gen = torch.Generator().manual_seed(seed)
    lengths = [CP_LENGTHS] if layout == "cp" else list(DP_LENGTHS)
    return [packed_batch(ls, args.vocab_size, gen) for ls in lengths]


def _reference_step(ref, batches) -> list[float]:
    """Backward of the mean over the dp replicas' batches (one batch at cp 2); returns each batch's loss."""
    losses = []
    for tokens, cu, max_len, labels in batches:
        loss = total(ref(tokens, cu, max_len, labels))
        (loss / len(batches)).backward()
        losses.append(loss.item())
    return losses


def _parallel_step(model, batches, layout: str, rank: int, cp_hooks) -> float:
    """This rank's share of the step, then ``reduce_gradients`` over the world for every unsharded parameter."""
    if layout == "cp":
        tokens, cu, max_len, labels = batches[0]
        model.cp = cp_hooks
        local = shard_thd_batch(tokens, labels, cu, cp_hooks.rank, cp_hooks.size)
        loss = total(model(local.tokens, local.cu_seqlens, max_len, local.labels))
    else:
        model.cp = SINGLE_DEVICE
        tokens, cu, max_len, labels = batches[rank]
        loss = total(model(tokens, cu, max_len, labels))
    loss.backward()
    reduce_gradients([p for p in model.parameters() if not isinstance(p, DTensor)], None, 2 if layout == "dp" else 1)
    return loss.item()


def _clip(model, max_norm: float) -> float:
    """The gradient norm (``clip_grad_norm``; experts replicated at ep 1), gradients clipped to ``max_norm``."""
    return clip_grad_norm(model.parameters(), max_norm).item()


def _grad_diff(model, other) -> tuple[float, str]:
    theirs = grads_of(other)
    return worst((n, g, theirs[n]) for n, g in grads_of(model).items())


def _param_diff(model, other) -> tuple[float, str]:
    theirs = dict(other.named_parameters())
    return worst((n, p, theirs[n]) for n, p in model.named_parameters())


def model_case(case: dict) -> dict:
    """Steps of the tiny model, one layout per step ("dp": dp 2 x cp 1, "cp": dp 1 x cp 2), vs one process.

    ``sharded``: apply_fsdp (experts ignored, reduced with reduce_gradients), else every gradient
    through reduce_gradients. ``twin``: also run the unsharded layout on a copy and compare the
    sharded run with it (``twin_*``). After the steps a sharded run saves a checkpoint to
    ``case["save"]`` and rank 0 writes the reference's model and optimizer state next to it.
    """
    from v4launch.checkpoints import ModelState, OptimizerState, save_checkpoint

    rank, dtype, layouts = dist.get_rank(), DTYPES[case["dtype"]], case["layouts"]
    args = tiny_args()
    model = build(args, case["phase"], torch.Generator().manual_seed(case["seed"]), dtype=dtype, chunk_size=64)
    ref = copy.deepcopy(model)
    twin = copy.deepcopy(model) if case.get("twin") else None
    experts = routed_expert_params([model])
    if case["sharded"]:
        apply_fsdp([model], None, dp=2 if layouts[0] == "dp" else 1, ignored_params=experts)
    cfg = OptimizerConfig(**{**OPT, **case.get("opt", {})})
    opt, ref_opt = Optimizers(model, cfg, muon_ns_dtype=dtype), Optimizers(ref, cfg, muon_ns_dtype=dtype)
    opts = [opt, ref_opt] + ([Optimizers(twin, cfg, muon_ns_dtype=dtype)] if twin is not None else [])
    cp_hooks, steps = ContextParallelGroup(), []
    for i, layout in enumerate(layouts):
        if case["sharded"] and i and layout != layouts[i - 1]:
            set_divide_factor([model], 2 if layout == "dp" else 1)
        batches = _batches(args, case["seed"] * 100 + i, layout)
        ref_losses = _reference_step(ref, batches)
        loss = _parallel_step(model, batches, layout, rank, cp_hooks)
        rec = dict(layout=layout, loss=abs(loss - ref_losses[0 if layout == "cp" else rank]), grad=_grad_diff(model, ref))
        if twin is not None:
            twin_loss = _parallel_step(twin, batches, layout, rank, cp_hooks)
            rec.update(twin_loss=abs(loss - twin_loss), twin_grad=_grad_diff(model, twin))
        clip = case.get("clip", CLIP)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()
        rec.update(norm=abs(_clip(model, clip) - ref_norm) / ref_norm, norm_value=ref_norm)
        if twin is not None:
            _clip(twin, clip)
        for o in opts:
            o.step()
            o.zero_grad()
        rec["param"] = _param_diff(model, ref)
        if twin is not None:
            rec["twin_param"] = _param_diff(model, twin)
        steps.append(rec)
    types = sorted({type(p).__name__ for p in model.parameters()})
    if case.get("save"):
        save_checkpoint(case["save"], len(layouts), {"model": ModelState(model),
                                                     "optimizer": OptimizerState(model, opt.optimizers)},
                        _manifest(world=2))
        if rank == 0:
            torch.save(full_state(ref, ref_opt), os.path.join(case["save"], "reference.pt"))
    return dict(steps=steps, param_types=types, expert_types=sorted({type(p).__name__ for p in experts}))


def full_state(model, opt: Optimizers) -> dict:
    """Whole (gathered) parameters and optimizer state of ``model`` keyed by FQN, for comparisons."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else (t.clone() if isinstance(t, torch.Tensor) else t)

    # nested (not the checkpoint's flattened per-parameter form) so state and groups compare by FQN
    optim = get_optimizer_state_dict(model, opt.optimizers)
    return {"params": {n: whole(p.detach()) for n, p in model.named_parameters()},
            "state": {fqn: {k: whole(v) for k, v in s.items()} for fqn, s in optim["state"].items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]]}


def compare_states(got: dict, want: dict) -> dict:
    """Max errors of parameters and optimizer state, and whether the key sets and groups match."""
    params = worst((n, got["params"][n], want["params"][n]) for n in want["params"])
    pairs = [(f"{fqn}/{k}", got["state"][fqn][k], v) for fqn, s in want["state"].items() for k, v in s.items()
             if isinstance(v, torch.Tensor)]
    return dict(params=params, state=worst(pairs), same_params=sorted(got["params"]) == sorted(want["params"]),
                same_state=sorted(got["state"]) == sorted(want["state"]) and len(want["state"]) > 0,
                same_groups=got["groups"] == want["groups"])


def load_case(case: dict) -> dict:
    """Load the unsharded checkpoint ``case["path"]`` into a freshly built sharded model + optimizer."""
    from v4launch.checkpoints import ModelState, OptimizerState, load_checkpoint

    dtype = DTYPES[case["dtype"]]
    model = build(tiny_args(), case["phase"], torch.Generator().manual_seed(case["seed"] + 1), dtype=dtype)
    apply_fsdp([model], None, dp=2, ignored_params=routed_expert_params([model]))
    opt = Optimizers(model, OptimizerConfig(**OPT), muon_ns_dtype=dtype)
    load_checkpoint(case["path"], {"model": ModelState(model), "optimizer": OptimizerState(model, opt.optimizers)})
    want = torch.load(os.path.join(case["path"], "reference.pt"), weights_only=False)
    return compare_states(full_state(model, opt), want)


def _manifest(world: int):
    from ckpt_helpers import manifest_for, tiny_dict

    from v4launch.validators.schema import Recipe

    sizes = {"world": world, "dp": world, "cp": 1, "pp": 1, "tp": 1, "ep": 1}
    return manifest_for(Recipe.model_validate(tiny_dict()), 2, step=3, parallel_sizes=sizes)


def optim_case(case: dict) -> dict:
    """Muon and AdamW on DTensor parameters (``Shard(0)`` over the world, uneven and empty shards) vs
    torch.optim.Muon / AdamW on the whole tensors, several steps; returns max errors and the shard rows."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from v4launch.training.muon import Muon

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    gen = torch.Generator().manual_seed(case["seed"])  # the same draws on every rank
    shapes = [tuple(s) for s in case["shapes"]]
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(case["steps"])]
    whole = [torch.nn.Parameter(w.clone()) for w in init]
    sharded = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in init]
    half = len(shapes) // 2
    make = {"muon": lambda ps, cls: cls([dict(params=ps[:half], nesterov=True),
                                         dict(params=ps[half:], nesterov=False, weight_decay=0.0)], lr=0.05),
            "adamw": lambda ps, cls: cls(ps, lr=0.05, weight_decay=0.1)}[case["optimizer"]]
    ours = make(sharded, Muon if case["optimizer"] == "muon" else torch.optim.AdamW)
    theirs = make(whole, torch.optim.Muon if case["optimizer"] == "muon" else torch.optim.AdamW)
    for step_grads in grads:
        for p, q, g in zip(sharded, whole, step_grads):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            q.grad = g.clone()
        ours.step(), theirs.step()
    state = [(f"{i}/{k}", ours.state[p][k], theirs.state[q][k]) for i, (p, q) in enumerate(zip(sharded, whole))
             for k in theirs.state[q] if k != "step"]
    return dict(param=worst((str(i), p, q) for i, (p, q) in enumerate(zip(sharded, whole))), state=worst(state),
                local_rows=[p.to_local().shape[0] for p in sharded],
                state_types=sorted({type(v).__name__ for _, v, _ in state}))


def error_case(case: dict) -> dict:
    """The ValueError messages of apply_fsdp / set_divide_factor / reduce_gradients."""
    msgs = {}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for key, call in [("dp", lambda: apply_fsdp([model], None, dp=3)),
                      ("unsharded", lambda: set_divide_factor([model], 1)),
                      ("reduce_dp", lambda: reduce_gradients(model.parameters(), None, 0))]:
        try:
            call()
        except ValueError as e:
            msgs[key] = str(e)
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).double())
    try:
        apply_fsdp([mixed], None, dp=2)
    except ValueError as e:
        msgs["dtypes"] = str(e)
    apply_fsdp([model], None, dp=2)
    for key, call in [("dp_after", lambda: set_divide_factor([model], 4)),
                      ("reduce_sharded", lambda: reduce_gradients(model.parameters(), None, 2))]:
        try:
            call()
        except ValueError as e:
            msgs[key] = str(e)
    return msgs
