"""Precision-aware optimizer storage (``Optimizers(storage=...)``): bf16 parameters over an exact fp32 master,
bf16 moments; the masters' trajectories against today's fp32 optimizers, bitwise; checkpoint round trips.

Every test draws fresh gradients (the seed is printed). Parameters the bf16 model stores in bf16 are the
matrices; the reference fp32 model starts from the same (bf16-representable) values and gets the same
gradients (drawn in bf16, upcast).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from v4launch.checkpoints.stateful import ModelState, OptimizerState
from v4launch.model.parallel.storage import apply_param_storage
from v4launch.training.master_weights import (INITIAL_REMAINDER, MASTER_PARAM, MASTER_REMAINDER, StorageOptions,
                                              join_master, split_master)
from v4launch.training.muon import Muon
from v4launch.training.optim import Optimizers, PrecisionAwareAdamW

STEPS = 50
BF16 = torch.bfloat16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(16, 8, bias=False)  # Muon; w2 and w3 share a shape: Newton-Schulz stacks them
        self.w2 = nn.Linear(8, 16, bias=False)
        self.w3 = nn.Linear(8, 16, bias=False)
        self.attn_norm = nn.Module()
        self.attn_norm.weight = nn.Parameter(torch.randn(16))  # AdamW, no decay


class _Tiny(nn.Module):
    """Names as V4Model's, so ``optim.group_kind`` sends matrices to Muon, head to AdamW with decay, norms without."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(16, 24, bias=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.randn(16))


def _gen() -> torch.Generator:
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    print(f"generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


def _models(gen: torch.Generator, n_low: int = 1) -> list[nn.Module]:
    """[fp32 reference, n_low copies whose matrices are bf16]; the matrices hold bf16-representable values."""
    ref = _Tiny()
    with torch.no_grad():
        for p in ref.parameters():
            value = torch.randn(p.shape, generator=gen)
            p.copy_(value.to(BF16) if p.ndim == 2 else value)
    lows = [copy.deepcopy(ref) for _ in range(n_low)]
    for low in lows:
        for p in low.parameters():
            if p.ndim == 2:
                p.data = p.data.to(BF16)
    return [ref, *lows]


def _feed(models: list[nn.Module], gen: torch.Generator) -> None:
    """Give every model the same gradients (drawn in bf16; each parameter gets them in its own dtype)."""
    for params in zip(*(m.parameters() for m in models)):
        g = (torch.randn(params[0].shape, generator=gen) * 0.1).to(BF16)
        for p in params:
            p.grad = g.to(p.dtype)


def _state(opts: Optimizers | torch.optim.Optimizer, p: torch.Tensor) -> dict:
    optimizers = opts.optimizers if isinstance(opts, Optimizers) else [opts]
    return next(o.state[p] for o in optimizers if p in o.state)


def _master(opts: Optimizers | torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """The fp32 master of ``p`` (joined from its remainder, or its copy; ``p`` itself when it is not bf16)."""
    if p.dtype != BF16:
        return p.detach()
    state = _state(opts, p)
    return state[MASTER_PARAM] if MASTER_PARAM in state else join_master(p, state[MASTER_REMAINDER])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``t`` (so -0.0 != 0.0 and NaN == NaN compare as bits)."""
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _cfg(weight_decay: float = 0.1) -> SimpleNamespace:
    """The fields of the recipe's ``optimizer`` section that ``Optimizers`` reads."""
    return SimpleNamespace(name="muon_adamw", lr=1e-2, muon_lr=2e-2, weight_decay=weight_decay, betas=(0.9, 0.95),
                           eps=1e-8, muon_momentum=0.95)


@pytest.mark.parametrize("remainders", [True, False], ids=["remainder", "fp32_copy"])
def test_a_clip_folded_into_fused_adamw_keeps_the_master_on_the_fp32_trajectory(remainders):
    """``Optimizers.step(clip=...)`` with fused AdamW hands the clip to ``_fused_adamw_`` as its ``grad_scale``;
    the bf16-parameter optimizer's fp32 temporaries get the same division, so its master still follows the fp32
    optimizer bitwise, step after step, with clipping active (coefficient < 1) every step."""
    gen = _gen()
    ref, low = _models(gen)
    cfg = SimpleNamespace(**{**vars(_cfg()), "name": "adamw"})  # Muon multiplies bf16 gradients in bf16
    ref_opt = Optimizers(ref, cfg, fused=True)
    low_opt = Optimizers(low, cfg, fused=True, storage=StorageOptions(store_param_remainders=remainders))
    for step in range(10):
        _feed([ref, low], gen)
        clip = torch.tensor(0.25 + 0.5 * torch.rand((), generator=gen).item())
        ref_opt.step(clip=clip)
        low_opt.step(clip=clip)
        for (name, r), q in zip(ref.named_parameters(), low.parameters()):
            assert _same(_master(low_opt, q), r.detach()), (step, name)


@pytest.mark.parametrize("remainders", [True, False], ids=["remainder", "fp32_copy"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no_decay", "decay"])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["ns_fp32", "ns_bf16"])
def test_master_follows_the_fp32_optimizer_bitwise(ns_dtype, weight_decay, remainders):
    gen = _gen()
    ref, low = _models(gen)
    ref_opt = Optimizers(ref, _cfg(weight_decay), muon_ns_dtype=ns_dtype)
    low_opt = Optimizers(low, _cfg(weight_decay), muon_ns_dtype=ns_dtype,
                         storage=StorageOptions(store_param_remainders=remainders))
    assert type(ref_opt.adamw) is torch.optim.AdamW and ref_opt.muon.storage is None  # today's path
    for step in range(STEPS):
        _feed([ref, low], gen)
        ref_opt.step()
        low_opt.step()
        for (name, r), q in zip(ref.named_parameters(), low.parameters()):
            assert _same(_master(low_opt, q), r.detach()), (step, name)
    for (name, r), q in zip(ref.named_parameters(), low.parameters()):
        ref_state, low_state = _state(ref_opt, r), _state(low_opt, q)
        for key in ref_state:
            assert _same(low_state[key], ref_state[key]), (name, key)
        if q.dtype == BF16:
            key = MASTER_REMAINDER if remainders else MASTER_PARAM
            assert set(low_state) == set(ref_state) | {key}, name
            assert _same(q.detach(), split_master(r.detach())[0]), name  # the fp32 weight rounded ties-away


@pytest.mark.parametrize("remainders", [True, False], ids=["remainder", "fp32_copy"])
def test_storage_applied_to_fp32_weights_keeps_their_exact_values_as_the_master(remainders, tmp_path):
    """apply_param_storage on weights that bf16 cannot hold: the master starts at the fp32 values (not their
    bf16 rounding), so the masters follow fp32 storage bitwise from the first step; a checkpoint's master
    replaces the waiting remainder (it is dropped on load, never used)."""
    gen = _gen()
    ref = _Tiny()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))  # 24 significant bits: not bf16-representable
    low, fresh = copy.deepcopy(ref), copy.deepcopy(ref)
    for model in (low, fresh):
        assert apply_param_storage(model, "bf16", fsdp=False)  # the matrices (not the norms)
    storage = StorageOptions(store_param_remainders=remainders)
    ref_opt, low_opt = Optimizers(ref, _cfg()), Optimizers(low, _cfg(), storage=storage)
    for step in range(5):
        _feed([ref, low], gen)
        ref_opt.step()
        low_opt.step()
        for (name, r), q in zip(ref.named_parameters(), low.parameters()):
            assert _same(_master(low_opt, q), r.detach()), (step, name)
            if q.dtype == BF16:
                assert _same(q.detach(), split_master(r.detach())[0]), (step, name)
    assert not any(hasattr(q, INITIAL_REMAINDER) for q in low.parameters())  # each became its master state
    dcp.save({"optimizer": OptimizerState(low, low_opt.optimizers)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    with torch.no_grad():
        for a, b in zip(low.parameters(), fresh.parameters()):
            b.copy_(a)  # the bf16 halves of the masters, as a checkpoint's model state would bring them
    fresh_opt = Optimizers(fresh, _cfg(), storage=storage)
    dcp.load({"optimizer": OptimizerState(fresh, fresh_opt.optimizers)},
             storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert not any(hasattr(q, INITIAL_REMAINDER) for q in fresh.parameters())  # the loaded masters rule
    for q, f in zip(low.parameters(), fresh.parameters()):
        assert _same(_master(fresh_opt, f), _master(low_opt, q))


def test_remainder_and_fp32_copy_give_the_same_parameters_and_masters():
    gen = _gen()
    _, with_rem, with_copy = _models(gen, n_low=2)
    storage = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    rem_opt = Optimizers(with_rem, _cfg(), storage=StorageOptions(**storage, store_param_remainders=True))
    copy_opt = Optimizers(with_copy, _cfg(), storage=StorageOptions(**storage, store_param_remainders=False))
    for step in range(STEPS):
        _feed([with_rem, with_copy], gen)
        rem_opt.step()
        copy_opt.step()
        for (name, a), b in zip(with_rem.named_parameters(), with_copy.parameters()):
            assert _same(a.detach(), b.detach()), (step, name)
            assert _same(_master(rem_opt, a), _master(copy_opt, b)), (step, name)
    moved = [not torch.equal(_master(rem_opt, p), p.float()) for p in with_rem.parameters() if p.dtype == BF16]
    assert any(moved)  # masters carry bits the bf16 parameters do not


@pytest.mark.parametrize("flags", [dict(), dict(foreach=True), dict(fused=True), dict(amsgrad=True),
                                   dict(maximize=True, weight_decay=0.0)],
                         ids=["single_tensor", "foreach", "fused", "amsgrad", "maximize"])
def test_adamw_implementations_match_torch_on_fp32_masters(flags):
    """Every implementation torch's AdamW may pick (fused runs on CPU too) gives the fp32 parameter's trajectory."""
    gen = _gen()
    shapes = [(8, 16), (16,), (3, 5, 2)]
    ref = [torch.randn(s, generator=gen).to(BF16).float().requires_grad_() for s in shapes]
    low = [r.detach().to(BF16).requires_grad_() for r in ref]
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) | flags
    ref_opt = torch.optim.AdamW(ref, **hyper)
    low_opt = PrecisionAwareAdamW(low, storage=StorageOptions(), **hyper)
    for step in range(20):
        for r, q in zip(ref, low):
            g = torch.randn(r.shape, generator=gen).to(BF16)
            r.grad, q.grad = g.float(), g
        ref_opt.step()
        low_opt.step()
        for i, (r, q) in enumerate(zip(ref, low)):
            assert _same(join_master(q, low_opt.state[q][MASTER_REMAINDER]), r.detach()), (step, i)
    for r, q in zip(ref, low):
        assert all(_same(low_opt.state[q][k], v) for k, v in ref_opt.state[r].items())


def test_both_master_variants_round_a_tied_master_away_from_zero():
    """A master exactly between two bf16 values (rare in training, so crafted here): the parameter is the
    ties-away value in both variants, not ``to(bfloat16)``'s nearest-even one."""
    tied = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 2.0**-130 + 2.0**-141])
    assert not torch.equal(tied.to(BF16), split_master(tied)[0])  # the crafted ties tell the roundings apart
    params = {}
    for remainders in (True, False):
        p = nn.Parameter(torch.zeros(4, dtype=BF16))
        storage = StorageOptions(store_param_remainders=remainders)
        opt = PrecisionAwareAdamW([p], lr=0.0, weight_decay=0.0, storage=storage)
        p.grad = torch.zeros_like(p)
        opt.step()  # creates the state; lr 0 leaves the master as it is
        if remainders:
            with torch.no_grad():
                p.copy_(split_master(tied)[0])
            opt.state[p][MASTER_REMAINDER].copy_(split_master(tied)[1])
        else:
            opt.state[p][MASTER_PARAM].copy_(tied)
        opt.step()
        assert _same(_master(opt, p), tied)
        params[remainders] = p.detach()
    assert _same(params[True], split_master(tied)[0]) and _same(params[False], params[True])


def _one_step_reference(opt: torch.optim.Optimizer, group: dict, masters: list[torch.Tensor], states: list[dict],
                        grads: list[torch.Tensor], ns_dtype: torch.dtype) -> tuple[list[torch.Tensor], list[dict]]:
    """One step of today's fp32 optimizer from fp32 copies of the masters and of the (upcast) stored states."""
    params = [m.clone().requires_grad_() for m in masters]
    keys = ("lr", "weight_decay")
    if isinstance(opt, Muon):
        ref = Muon(params, momentum=group["momentum"], nesterov=group["nesterov"], ns_dtype=ns_dtype,
                   **{k: group[k] for k in keys})
    else:
        ref = torch.optim.AdamW(params, betas=group["betas"], eps=group["eps"], **{k: group[k] for k in keys})
    for p, state, g in zip(params, states, grads):
        ref.state[p] = {k: (v.clone() if k == "step" else v.float()) for k, v in state.items()
                        if k not in (MASTER_REMAINDER, MASTER_PARAM)}
        p.grad = g.float()
    ref.step()
    return [p.detach() for p in params], [ref.state[p] for p in params]


def test_bf16_states_are_one_fp32_step_rounded_to_nearest_even():
    """With bf16 moments: the step upcasts them, runs today's fp32 math (the master bitwise as an fp32 optimizer
    started from the upcast states), and stores them rounded to nearest even; float64 agrees to the rounding."""
    gen = _gen()
    _, low = _models(gen)
    ns_dtype = torch.float32
    opts = Optimizers(low, _cfg(), muon_ns_dtype=ns_dtype, storage=StorageOptions(BF16, BF16, True))
    for _ in range(5):
        _feed([low], gen)
        opts.step()
    _feed([low], gen)
    expected = []
    for opt in opts.optimizers:
        for group in opt.param_groups:
            params = group["params"]
            before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
            masters = [_master(opts, p).clone() for p in params]
            grads = [p.grad.clone() for p in params]
            ref_masters, ref_states = _one_step_reference(opt, group, masters, before, grads, ns_dtype)
            expected.append((opt, group, params, before, grads, ref_masters, ref_states))
    opts.step()
    for opt, group, params, before, grads, ref_masters, ref_states in expected:
        for p, old, g, ref_master, ref_state in zip(params, before, grads, ref_masters, ref_states):
            assert _same(_master(opts, p), ref_master), group["name"]
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if key not in old:
                    continue
                stored = opt.state[p][key]
                assert stored.dtype == BF16, (group["name"], key)  # fp32 parameters' states too
                assert _same(stored, ref_state[key].to(BF16)), (group["name"], key)
                weight = (1 - group["momentum"]) if key == "momentum_buffer" else (
                    1 - group["betas"][0] if key == "exp_avg" else 1 - group["betas"][1])
                g64 = g.double() if key != "exp_avg_sq" else g.double() ** 2
                exact = old[key].double() * (1 - weight) + g64 * weight
                assert bool(((stored.double() - exact).abs() <= exact.abs() * (2.0**-8 + 2.0**-20) + 1e-38).all())


@pytest.mark.parametrize("remainders", [True, False], ids=["remainder", "fp32_copy"])
def test_checkpoint_round_trip_restores_states_bitwise_and_the_next_step(remainders, tmp_path):
    gen = _gen()
    storage = StorageOptions(BF16, torch.float32, remainders)
    _, run, fresh = _models(gen, n_low=2)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # the loaded run must not inherit anything from the fresh model
    run_opt = Optimizers(run, _cfg(), storage=storage)
    for _ in range(3):
        _feed([run], gen)
        run_opt.step()
    saved = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v))
             for k, v in OptimizerState(run, run_opt.optimizers).state_dict().items()}
    assert any(k.endswith("." + storage.master_key) for k in saved)
    dcp.save({"model": ModelState(run), "optimizer": OptimizerState(run, run_opt.optimizers)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    fresh_opt = Optimizers(fresh, _cfg(), storage=storage)
    dcp.load({"model": ModelState(fresh), "optimizer": OptimizerState(fresh, fresh_opt.optimizers)},
             storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    loaded = OptimizerState(fresh, fresh_opt.optimizers).state_dict()
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert _same(loaded[key], value) if torch.is_tensor(value) else loaded[key] == value, key
    _feed([run, fresh], gen)
    run_opt.step()
    fresh_opt.step()
    for (name, a), b in zip(run.named_parameters(), fresh.parameters()):
        assert _same(a.detach(), b.detach()) and _same(_master(run_opt, a), _master(fresh_opt, b)), name
    after = OptimizerState(run, run_opt.optimizers).state_dict()
    for key, value in OptimizerState(fresh, fresh_opt.optimizers).state_dict().items():
        assert _same(value, after[key]) if torch.is_tensor(value) else value == after[key], key


def test_loading_a_state_of_another_master_storage_is_refused():
    gen = _gen()
    _, low = _models(gen)
    opts = Optimizers(low, _cfg(), storage=StorageOptions(store_param_remainders=True))
    _feed([low], gen)
    opts.step()
    state = opts.muon.state_dict()
    other = Muon(list(opts.muon.param_groups[0]["params"]), storage=StorageOptions(store_param_remainders=False))
    with pytest.raises(ValueError, match="has no 'master_param'.*Fix: resume with"):
        other.load_state_dict(state)


def test_float16_parameters_are_refused_and_summary_reports_the_storage():
    with pytest.raises(ValueError, match="float16 parameter.*Fix"):
        PrecisionAwareAdamW([nn.Parameter(torch.zeros(3, dtype=torch.float16))], storage=StorageOptions())
    with pytest.raises(ValueError, match="float16 parameter"):
        Muon([nn.Parameter(torch.zeros(3, 3, dtype=torch.float16))], storage=StorageOptions())
    _, low = _models(torch.Generator().manual_seed(0))
    summary = Optimizers(low, _cfg(), storage=StorageOptions(BF16, torch.float32, False)).summary(low)
    assert summary["muon/base"]["storage"] == {"master": "fp32_copy", "momentum_buffer": "bfloat16"}
    assert summary["adamw_decay/base"]["storage"] == {"master": "fp32_copy", "exp_avg": "bfloat16",
                                                      "exp_avg_sq": "float32"}
    assert summary["adamw_no_decay/base"]["storage"]["master"] == "none"  # fp32 norms: no master
    assert "storage" not in Optimizers(low, _cfg()).summary(low)["muon/base"]  # default: today's summary


def test_fsdp_sharded_parameters_take_bf16_states_and_masters(tmp_path):
    """FSDP2 (``fully_shard``) on a gloo world of one process: the parameters are DTensors ``Shard(0)``; their
    bf16 states and int16 remainders are DTensors too, and the run equals the plain one bitwise. (One rank:
    the local piece is the whole tensor; tests/model/fsdp/test_fsdp_optim.py covers uneven shards on two.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    gen = _gen()
    storage = StorageOptions(BF16, BF16, True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for dtype in (torch.float32, BF16):  # fp32 shards with bf16 states; bf16 shards with masters
            _, plain = _models(gen)
            plain = plain.to(dtype)
            sharded = copy.deepcopy(plain)
            fully_shard(sharded, mesh=mesh)
            assert all(isinstance(p, DTensor) for p in sharded.parameters())
            plain_opt, sharded_opt = (Optimizers(m, _cfg(), muon_ns_dtype=torch.float32, storage=storage)
                                      for m in (plain, sharded))
            for _ in range(5):
                for p, q in zip(plain.parameters(), sharded.parameters()):
                    p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(dtype)
                    q.grad = DTensor.from_local(p.grad.clone(), q.device_mesh, q.placements)
                plain_opt.step()
                sharded_opt.step()
            for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
                assert _same(q.full_tensor().detach(), p.detach()), name
                plain_state, sharded_state = _state(plain_opt, p), _state(sharded_opt, q)
                assert set(plain_state) == set(sharded_state), name
                for key, value in plain_state.items():
                    got = sharded_state[key]
                    if key != "step":
                        assert isinstance(got, DTensor), (name, key)
                        got = got.full_tensor()
                    assert _same(got, value), (name, key)
                keys = set(plain_state) - {"step"}
                stored = {BF16} if dtype == torch.float32 else {BF16, torch.int16}
                assert {sharded_state[k].dtype for k in keys} == stored
    finally:
        dist.destroy_process_group()
