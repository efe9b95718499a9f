"""Which parameters go to Muon and which to AdamW; FP32-pinned parameters and recorded dtypes."""

from __future__ import annotations

import re

import pytest
import torch

from v4launch.model import ModelArgs, V4Model
from v4launch.training.optim import Optimizers
from v4launch.validators.schema import OptimizerConfig

ARGS = ModelArgs(vocab_size=264, dim=32, n_layers=3, n_mtp_layers=1, compress_ratios=(0, 4, 128, 0), n_heads=2,
                 head_dim=32, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, window_size=16,
                 index_n_heads=2, index_head_dim=32, index_topk=4, n_routed_experts=4, n_activated_experts=2,
                 moe_inter_dim=32, n_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=3)

ADAMW = re.compile(r"(^embed\.weight$|^head\.weight$|norm\.weight$|(^|\.)hc_|\.ape$|\.attn_sink$|ffn\.gate\.weight$)")


def _where(opt: Optimizers, model) -> dict[str, str]:
    out = {}
    for group, info in opt.summary(model).items():
        for name in info["names"]:
            assert name not in out, f"{name} is in two groups"
            out[name] = group
    return out


@pytest.mark.parametrize("phase", ["dense", "warmup"])
def test_muon_gets_hidden_matrices_and_adamw_the_rest(phase):
    model = V4Model(ARGS, phase=phase)
    opt = Optimizers(model, OptimizerConfig(name="muon_adamw"))
    where = _where(opt, model)
    assert set(where) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        kind = where[name].split("/")[0]
        if ADAMW.search(name) or p.ndim != 2:
            assert kind.startswith("adamw"), name
        else:
            assert kind == "muon", name
        assert where[name].endswith("/indexer") == (".indexer." in name), name
    assert isinstance(opt.muon, torch.optim.Muon) and isinstance(opt.adamw, torch.optim.AdamW)
    no_decay = [n for n, g in where.items() if g.startswith("adamw_no_decay")]
    assert all(ADAMW.search(n) and not n.endswith(("embed.weight", "head.weight", "gate.weight")) for n in no_decay)


def test_adamw_recipe_puts_everything_in_adamw():
    model = V4Model(ARGS, phase="warmup")
    opt = Optimizers(model, OptimizerConfig(name="adamw"))
    assert opt.muon is None
    assert all(not g.startswith("muon") for g in _where(opt, model).values())


def test_phase_change_adds_indexer_groups_after_the_base_groups():
    model = V4Model(ARGS, phase="dense")
    opt = Optimizers(model, OptimizerConfig())
    before = [g["name"] for g in opt.param_groups]
    seen = {n for n, _ in model.named_parameters()}
    model.set_phase("warmup")
    opt.add_params(model, [(n, p) for n, p in model.named_parameters() if n not in seen], "indexer")
    fresh = Optimizers(V4Model(ARGS, phase="warmup"), OptimizerConfig())
    assert [g["name"] for g in opt.param_groups] == [g["name"] for g in fresh.param_groups]
    assert set(before) < {g["name"] for g in opt.param_groups}
    assert any(g["name"].endswith("/indexer") for g in opt.param_groups)


def test_pinned_fp32_parameters_stay_fp32_and_are_recorded_per_group():
    model = V4Model(ARGS, phase="warmup").to(torch.bfloat16)
    pinned = [n for n, p in model.named_parameters() if re.search(r"(\.ape$|\.attn_sink$|(^|\.)hc_)", n)]
    assert pinned
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if name in pinned else torch.bfloat16), name
    summary = Optimizers(model, OptimizerConfig()).summary(model)
    assert set(summary["adamw_no_decay/base"]["dtypes"]) == {"bfloat16", "float32"}  # norms bf16, mHC/sink fp32
    assert set(summary["muon/base"]["dtypes"]) == {"bfloat16"}
