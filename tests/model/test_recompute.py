"""Activation recompute (parallel/recompute.py): selective regions and whole layers (granularity full) give the
same gradients, are really recomputed, keep the names; V4 refusals; replayed CP collectives at cp 2.

References: the same model without recompute (a deep copy, float64, fresh random weights and
batches); the count of each region's calls during backward; the bytes autograd keeps for backward.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from v4_helpers import build, gloo_spawn, packed_batch, tiny_args

from v4launch.model import model as model_module
from v4launch.model.attention import Attention
from v4launch.model.common import RMSNorm
from v4launch.model.kernels import dispatch
from v4launch.model.moe import MoE, Expert
from v4launch.model.parallel.pipeline import StageSpec, cut_stage, stage_specs
from v4launch.model.model import Block
from v4launch.model.parallel.recompute import FULL_LAYER, REGIONS, apply_recompute, modules_from_recipe, recomputed_regions

ALLOWED = ["layernorm", "mla_up_proj", "moe_act", "shared_experts", "moe", FULL_LAYER]
METHOD = {"layernorm": (RMSNorm, "forward"), "mla_up_proj": (Attention, "project_query"),
          "moe_act": (Expert, "activation"), "shared_experts": (Expert, "forward"), "moe": (MoE, "forward"),
          FULL_LAYER: (Block, "forward")}
LENGTHS = [37, 140, 21]  # three segments: CSA entries in each, HCA (ratio 128) entries in the 140-token one


def total(out) -> torch.Tensor:
    return out.lm_loss + sum(out.aux_losses.values())


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """(bytes of the distinct storages autograd keeps for backward while ``fn()`` runs, its result)."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _stand_in_kernels(monkeypatch, model) -> None:
    """The reference kernel functions under a fused backend's name: the model runs kernels/layer.py's path."""
    fake = dataclasses.replace(dispatch.select_backend("reference", "cpu"), name="triton")
    monkeypatch.setattr(model_module, "select_backend", lambda name, device: fake)
    model.set_kernel_backend("triton")


@pytest.mark.parametrize("names", [[n] for n in ALLOWED] + [["layernorm", "mla_up_proj", "moe_act", "shared_experts"]],
                         ids=lambda n: "+".join(n))  # [full]: granularity full, every layer whole
@pytest.mark.parametrize("phase", ["dense", "sparse"])
def test_gradients_equal_and_regions_recomputed(names, phase, gen, monkeypatch):
    args = tiny_args()
    plain = build(args, phase, gen, chunk_size=16)
    rec = copy.deepcopy(plain)
    regions = apply_recompute(rec, names)
    assert regions and regions == recomputed_regions(rec)
    calls = {n: 0 for n in names}
    for n in names:  # count every call of the region's own method (the recompute class calls it by name)
        cls, attr = METHOD[n]
        original = getattr(cls, attr)

        def counting(self, *a, _orig=original, _n=n, _attr=attr, **k):
            if _attr in getattr(type(self), "_v4_recompute_attrs", ()):  # only the instances under recompute
                calls[_n] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(cls, attr, counting)
    tokens, cu, max_len, labels = packed_batch(LENGTHS, args.vocab_size, gen)
    want = total(plain(tokens, cu, max_len, labels))
    want.backward()
    got = total(rec(tokens, cu, max_len, labels))
    in_forward = dict(calls)
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
    ref = _grads(plain)
    assert set(_grads(rec)) == set(ref)
    worst = max(_rel_err(g, ref[k]) for k, g in _grads(rec).items())
    assert worst <= 1e-12, worst
    for n in names:  # every region ran in forward and again in backward (more when nested in another region)
        assert in_forward[n] > 0, n
        assert calls[n] == 2 * in_forward[n] if len(names) == 1 else calls[n] >= 2 * in_forward[n], (n, calls)


@pytest.mark.parametrize("name", ALLOWED)
def test_recompute_frees_the_regions_activations(name, gen):
    """Fewer bytes kept for backward than without recompute, and the same loss."""
    args = tiny_args()
    plain = build(args, "sparse", gen, chunk_size=16)
    rec = copy.deepcopy(plain)
    apply_recompute(rec, [name])
    tokens, cu, max_len, labels = packed_batch(LENGTHS, args.vocab_size, gen)
    kept_plain, out_plain = _saved_bytes(lambda: total(plain(tokens, cu, max_len, labels)))
    kept_rec, out_rec = _saved_bytes(lambda: total(rec(tokens, cu, max_len, labels)))
    assert kept_rec < kept_plain, (kept_rec, kept_plain)
    assert out_rec.item() == pytest.approx(out_plain.item(), rel=1e-12)


@pytest.mark.parametrize("names", [["mla_up_proj", "layernorm"], [FULL_LAYER]], ids="+".join)
def test_kernel_path_gradients_equal(names, gen, monkeypatch):
    """The fused-kernel layer code (kernels/layer.py) calls project_query too, and a whole layer re-runs the
    kernel path (its top-k and saved kernel outputs): same gradients there."""
    args = tiny_args()
    plain = build(args, "sparse", gen, chunk_size=16)
    rec = copy.deepcopy(plain)
    apply_recompute(rec, names)
    for m in (plain, rec):
        _stand_in_kernels(monkeypatch, m)
    tokens, cu, max_len, labels = packed_batch(LENGTHS, args.vocab_size, gen)
    total(plain(tokens, cu, max_len, labels)).backward()
    total(rec(tokens, cu, max_len, labels)).backward()
    ref = _grads(plain)
    assert max(_rel_err(g, ref[k]) for k, g in _grads(rec).items()) <= 1e-12


def test_names_state_dict_and_copies_unchanged(gen):
    args = tiny_args()
    plain = build(args, "sparse", gen)
    rec = copy.deepcopy(plain)
    apply_recompute(rec, ALLOWED[:-1])
    assert [n for n, _ in rec.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in rec.named_buffers()] == [n for n, _ in plain.named_buffers()]
    state = rec.state_dict()
    assert list(state) == list(plain.state_dict())
    assert not any("_checkpoint_wrapped_module" in k for k in state)
    plain.load_state_dict(state)  # strict: the keys match both ways
    twin = copy.deepcopy(rec)  # a copy recomputes its own modules, with its own parameters
    assert recomputed_regions(twin) == recomputed_regions(rec)
    tokens, cu, max_len, labels = packed_batch(LENGTHS, args.vocab_size, gen)
    total(twin(tokens, cu, max_len, labels)).backward()
    assert all(p.grad is None for p in rec.parameters())
    assert sum(p.grad is not None for p in twin.parameters()) > 0


def test_applying_twice_changes_nothing(gen):
    args = tiny_args()
    model = build(args, "dense", gen)
    first = apply_recompute(model, ["layernorm", "moe_act"])
    classes = {n: type(m) for n, m in model.named_modules()}
    assert apply_recompute(model, ["layernorm", "moe_act"]) == first
    assert {n: type(m) for n, m in model.named_modules()} == classes
    both = apply_recompute(model, ["shared_experts"])  # adds to what is there
    assert set(first) < set(both) and "layers.0.ffn.shared_experts.activation" in both
    assert isinstance(model.layers[0].ffn.shared_experts, Expert)


@pytest.mark.parametrize("name", ["moe", FULL_LAYER])
def test_moe_recompute_counts_expert_tokens_once(name, gen):
    args = tiny_args()
    plain = build(args, "dense", gen)
    rec = copy.deepcopy(plain)
    apply_recompute(rec, [name])
    tokens, cu, max_len, labels = packed_batch(LENGTHS, args.vocab_size, gen)
    for m in (plain, rec):
        total(m(tokens, cu, max_len, labels)).backward()
    for a, b in zip(plain.layers.values(), rec.layers.values()):
        assert a.ffn.expert_counts.sum() > 0 and torch.equal(a.ffn.expert_counts, b.ffn.expert_counts)
    assert rec.training and all(b.ffn.training for b in rec.layers.values())


def test_pipeline_parts_keep_single_device_names(gen):
    """Applied to each stage after the split, the regions are the whole model's, under the same FQNs."""
    args = tiny_args()
    whole = build(args, "sparse", gen)
    split = copy.deepcopy(whole)
    want = apply_recompute(whole, ["layernorm", "mla_up_proj"])
    parts = [cut_stage(split, s) for s in stage_specs("Et*2|t*2mL", 2, 1, args.n_layers, args.n_mtp_layers)]
    got = [apply_recompute(p, ["layernorm", "mla_up_proj"]) for p in parts]
    assert all(r.startswith("layers.0.") or r.startswith("layers.1.") for r in got[0])
    assert sorted(got[0] + got[1]) == want
    head_only = cut_stage(split, StageSpec(index=1, n_stages=2, pp_rank=1, layer_ids=(), has_embed=False,
                                           has_mtp=False, has_loss=True))
    assert apply_recompute(head_only, ["layernorm"]) == []


def test_refusals_name_field_value_rule_and_fix(gen):
    cases = [
        (lambda: modules_from_recipe("selective", ["mla_up_proj", "core_attn"]), r"parallel\.recompute_modules="
         r"\['mla_up_proj', 'core_attn'\]: V4-RECOMPUTE: 'core_attn' recompute is rejected.*Fix: set parallel\."
         r"recompute_granularity=selective and list modules from layernorm"),
        (lambda: modules_from_recipe("selective", ["mlp"]), r"recompute_modules=\['mlp'\]: V4-RECOMPUTE: 'mlp'.*every "
         r"V4 FFN is a MoE.*Fix: "),
        (lambda: modules_from_recipe("selective", ["attn"]), r"\['attn'\]: V4-RECOMPUTE: 'attn' is not a recompute "
         r"module name \(known: core_attn, layernorm"),
        (lambda: modules_from_recipe("selective", []), r"recompute_modules=\[\]: V4-RECOMPUTE: selective recompute "
         r"without modules means \['core_attn'\]"),
        (lambda: modules_from_recipe("none", ["layernorm"]), r"parallel\.recompute_modules=\['layernorm'\]: V4-RECOMPUTE: "
         r"recompute_granularity=none: these modules would be ignored\. Fix: set parallel\.recompute_granularity"
         r"=selective"),
        (lambda: modules_from_recipe("full", ["moe"]), r"recompute_granularity=full: these modules would be ignored"),
        (lambda: modules_from_recipe("block", []), r"parallel\.recompute_granularity='block': V4-RECOMPUTE: must be "
         r"none, selective or full"),
        (lambda: apply_recompute(build(tiny_args(n_shared_experts=0), "dense", gen), ["shared_experts"]),
         r"\['shared_experts'\]: V4-RECOMPUTE: 'shared_experts' with model\.moe\.n_shared_experts=0.*Fix: drop "
         r"'shared_experts'"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()
    assert modules_from_recipe("none", []) == []
    assert modules_from_recipe("full", []) == [FULL_LAYER]
    assert modules_from_recipe("selective", ["moe_act", "layernorm", "moe_act"]) == ["moe_act", "layernorm"]
    assert set(REGIONS) == {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}


def test_schema_names_are_the_regions():
    """The recipe schema's RecomputeModule literal and REGIONS name the same modules."""
    from typing import get_args

    from v4launch.validators.schema.parallel import RecomputeModule

    assert set(get_args(RecomputeModule)) == set(REGIONS)


# ------------------------------------------------------------------ CP = 2 and FSDP2, gloo
CP_LENGTHS = [5, 140, 60, 51]  # T = 256: L = 128 = the HCA boundary width at cp 2; one segment spans both ranks


def cp_fsdp_case(case: dict) -> dict:
    """Both ranks: the tiny model at cp 2 under FSDP2 (S = 2, dp 1), with and without recompute."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torch.distributed.tensor import DTensor

    from v4launch.model.parallel import ContextParallelGroup, shard_thd_batch
    from v4launch.model.parallel.fsdp import apply_fsdp, routed_expert_params

    args = tiny_args()
    gen = torch.Generator().manual_seed(case["seed"])
    plain = build(args, "sparse", gen, chunk_size=32)
    rec = copy.deepcopy(plain)
    regions = apply_recompute(rec, case["names"])
    tokens, cu, max_len, labels = packed_batch(CP_LENGTHS, args.vocab_size, gen)
    out = {"regions": len(regions)}
    for key, m in (("plain", plain), ("rec", rec)):
        apply_fsdp([m], None, dp=1, ignored_params=routed_expert_params([m]))
        m.cp = ContextParallelGroup()
        local = shard_thd_batch(tokens, labels, cu, m.cp.rank, m.cp.size)
        loss = total(m(local.tokens, local.cu_seqlens, max_len, local.labels))
        loss.backward()
        out[key] = dict(loss=loss.item(), collectives=len(m.cp.traffic.records),
                        sharded=sum(isinstance(p, DTensor) for p in m.parameters()),
                        names=[n for n, _ in m.named_parameters()])
        out[key + "_grads"] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                               for n, p in m.named_parameters() if p.grad is not None}
    ref = out.pop("plain_grads")
    got = out.pop("rec_grads")
    out["same_grads"] = set(ref) == set(got)
    out["grad_err"] = max(_rel_err(g, ref[n]) for n, g in got.items())
    return out


def test_cp2_fsdp_recompute_replays_no_collective(tmp_path):
    """cp 2 with FSDP2 applied after recompute: equal gradients, and backward runs no extra CP collective."""
    names = ["layernorm", "mla_up_proj", "moe_act", "shared_experts"]
    results = gloo_spawn(2, [dict(seed=int(torch.randint(0, 2**31 - 1, (1,))), names=names)], tmp_path, cp_fsdp_case)
    for rank in results:
        r = rank[0]
        assert r["regions"] > 0 and r["same_grads"] and r["grad_err"] <= 1e-12, r
        assert abs(r["rec"]["loss"] - r["plain"]["loss"]) <= 1e-12 * abs(r["plain"]["loss"])
        assert r["rec"]["collectives"] == r["plain"]["collectives"] > 0
        assert r["rec"]["sharded"] == r["plain"]["sharded"] > 0 and r["rec"]["names"] == r["plain"]["names"]


@pytest.mark.parametrize("names", [[FULL_LAYER], ["moe"]], ids="+".join)
def test_cp2_fsdp_recompute_replaying_collectives_gives_the_same_gradients(names, tmp_path):
    """Whole layers (and the MoE with its balance-loss CP sums) at cp 2 under FSDP2: backward replays the CP
    boundary exchange and all-gathers of each layer on both ranks in the same order, with equal gradients."""
    results = gloo_spawn(2, [dict(seed=int(torch.randint(0, 2**31 - 1, (1,))), names=names)], tmp_path, cp_fsdp_case)
    for rank in results:
        r = rank[0]
        assert r["regions"] > 0 and r["same_grads"] and r["grad_err"] <= 1e-12, r
        assert abs(r["rec"]["loss"] - r["plain"]["loss"]) <= 1e-12 * abs(r["plain"]["loss"])
        assert r["rec"]["collectives"] > r["plain"]["collectives"] > 0  # the replays
        assert r["rec"]["sharded"] == r["plain"]["sharded"] > 0 and r["rec"]["names"] == r["plain"]["names"]
