"""The V4 precision policy applied to the model (parallel/precision.py): the FP8 filter, the table, the conversion.

The expected decisions are written out here from the released model's dtype table
(reference/v4-model-spec.md §1) and the policy pins (seed 000 §9, seed 004 items 4 and 6), not
computed by the code under test. torchao's float8 training needs an SM89+ GPU to run; on the CPU its
emulation (FP8 rounding, high-precision GEMMs) shows that the converted modules are the ones run.
"""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch
from torch import nn

from v4_helpers import build, packed_batch, tiny_args

from v4launch.model.moe import MoE
from v4launch.model.parallel.precision import (apply_fp8, check_precision_policy, describe_precision,
                                               fp8_module_filter, precision_table, torchao_config)
from v4launch.validators.schema import PrecisionConfig

FP8_SUFFIXES = {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "ffn.shared_experts.w1", "ffn.shared_experts.w2",
                "ffn.shared_experts.w3", "e_proj", "h_proj"}
"""Released FP8 GEMMs (spec §1) minus indexer.wq_b, which the policy keeps high precision by default."""
ALIGNED = dict(q_lora_rank=32, o_lora_rank=16, moe_inter_dim=32)  # every GEMM dimension a multiple of 16


def expected(fqn: str, recipe: str, compute: str, indexer_qk: str = "bf16") -> str:
    suffix = re.sub(r"^(layers|mtp)\.\d+\.", "", fqn)
    if recipe != "none" and (suffix in FP8_SUFFIXES or (suffix == "attn.indexer.wq_b" and indexer_qk == "fp8")):
        return "fp8"
    return compute


def total(out) -> torch.Tensor:
    return out.lm_loss + sum(out.aux_losses.values())


@pytest.mark.parametrize("recipe,dtype", [("blockwise", "bf16"), ("delayed", "fp32"), ("none", "bf16"),
                                          ("none", "fp32")])
def test_filter_decides_every_linear_as_the_policy_says(recipe, dtype, gen):
    model = build(tiny_args(), "sparse", gen)
    filt = fp8_module_filter(PrecisionConfig(dtype=dtype, fp8_recipe=recipe))
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) > 40
    for fqn, module in linears:
        assert filt.decide(fqn)[0] == expected(fqn, recipe, dtype), fqn
        assert filt(module, fqn) == (expected(fqn, recipe, dtype) == "fp8"), fqn
    assert not filt(model.layers[1].ffn.gate, "layers.1.ffn.gate")  # the router is not a Linear
    fp8 = {n for n, m in linears if filt(m, n)}
    if recipe != "none":  # the attention projections and shared experts of every block and MTP layer
        assert len(fp8) == 4 * (model.args.n_layers + 1) + 3 * (model.args.n_layers + 1) + 2
        assert not any(".compressor." in n or ".indexer." in n or ".experts." in n or n.endswith("wo_a") for n in fp8)
    else:
        assert fp8 == set()


def test_indexer_q_projection_follows_the_opt_in():
    """precision.policy.indexer_qk=fp8 (with attention.indexer_qat) lets the indexer's Q projection run FP8."""
    opted = fp8_module_filter(PrecisionConfig(fp8_recipe="blockwise", policy={"indexer_qk": "fp8"}))
    default = fp8_module_filter(PrecisionConfig(fp8_recipe="blockwise"))
    assert opted.decide("layers.1.attn.indexer.wq_b")[0] == "fp8"
    assert default.decide("layers.1.attn.indexer.wq_b")[0] == "bf16"
    assert opted.decide("layers.1.attn.indexer.weights_proj")[0] == "bf16"


def test_table_lists_gemms_and_fp32_pins(gen):
    model = build(tiny_args(), "sparse", gen, dtype=torch.float32)
    filt = fp8_module_filter(PrecisionConfig(dtype="bf16", fp8_recipe="blockwise"))
    table = dict(precision_table(model, filt))
    assert table["layers.1.attn.attn_sink"] == "fp32" and table["layers.1.attn.compressor.ape"] == "fp32"
    assert table["layers.1.attn.indexer.compressor.ape"] == "fp32"
    assert table["layers.2.ffn.gate"] == "bf16" and table["head"] == "bf16"
    assert table["mtp.0.e_proj"] == "fp8" and table["layers.3.attn.compressor.wgate"] == "bf16"
    text = describe_precision(model, filt)
    assert text.startswith("precision: compute bf16, fp8_recipe blockwise -> torchao rowwise")
    assert re.search(r"layers\.\*\.ffn\.experts\.\*\.w1 +bf16 x16 +routed experts: grouped GEMMs over the stacked", text)
    for moe in (m for m in model.modules() if hasattr(m, "fp8_experts")):
        moe.fp8_experts = True  # as apply_fp8 sets it on an SM90 GPU: the grouped GEMM reads these weights in FP8
    table = dict(precision_table(model, filt))
    routed = [n for n in table if ".ffn.experts." in n]
    n_routed = sum(1 for n, _ in model.named_modules() if re.search(r"ffn\.experts\.\d+$", n))  # blocks and MTP
    assert n_routed > 16 and len(routed) == 3 * n_routed and all(table[n] == "fp8" for n in routed)
    assert table["layers.1.ffn.shared_experts.w1"] == "fp8" and table["layers.1.attn.indexer.wq_b"] == "bf16"
    assert re.search(r"layers\.\*\.attn\.indexer\.weights_proj +bf16 x2 +indexer head-weight projection: "
                     r"precision\.policy\.indexer_weights_proj=bf16", text)


def test_policy_refusals_name_field_value_rule_and_fix():
    cases = [
        ({"compressor_gemm": "fp8"}, r"precision\.policy\.compressor_gemm=fp8: V4-PREC-BF16-PINS.*Fix: set "
                                     r"precision\.policy\.compressor_gemm=bf16"),
        ({"indexer_weights_proj": "fp8"}, r"indexer_weights_proj=fp8: V4-PREC-BF16-PINS.*Fix: "),
        ({"ape": "bf16"}, r"precision\.policy\.ape=bf16: V4-PREC-FP32-PINS.*Fix: set precision\.policy\.ape=fp32"),
        ({"attn_sink": "bf16"}, r"attn_sink=bf16: V4-PREC-FP32-PINS.*Fix: "),
        ({"indexer_qk": "fp4"}, r"precision\.policy\.indexer_qk=fp4: the indexer QK product is an einsum.*"
                                r"Fix: set precision\.policy\.indexer_qk=bf16"),
    ]
    for policy, pattern in cases:
        for recipe in ("none", "blockwise"):  # refused whether or not FP8 is on
            with pytest.raises(ValueError, match=pattern):
                check_precision_policy(PrecisionConfig(fp8_recipe=recipe, policy=policy))
    with pytest.raises(ValueError, match=r"precision\.fp8_recipe=mxfp8: V4-FP8-SM: .*MXFP8 needs SM100\+.*Fix: set "
                                         r"precision\.fp8_recipe=blockwise"):
        torchao_config("mxfp8")


def test_refusals_of_device_alignment_and_missing_torchao(gen, monkeypatch):
    pytest.importorskip("torchao.float8")
    fp8 = PrecisionConfig(fp8_recipe="blockwise")
    model = build(tiny_args(**ALIGNED), "dense", gen, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"precision\.fp8_recipe=blockwise: V4-FP8-SM: the model is on cpu, which has "
                                         r"no FP8 tensor cores\. Fix: run on an SM89\+ GPU"):
        apply_fp8(model, fp8)
    misaligned = build(tiny_args(), "dense", gen, dtype=torch.float32)  # q_lora_rank 24
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a is a 32 -> 24 GEMM.*multiples of 16\. Fix: "):
        apply_fp8(misaligned, fp8, emulate=True)
    assert all(type(m) is nn.Linear for m in misaligned.modules() if isinstance(m, nn.Linear))  # nothing half-done
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(ValueError, match=r"fp8_recipe=blockwise: FP8 training needs torchao.*Fix: pip install "
                                         r"'v4launch\[fp8\]'.*or set precision\.fp8_recipe=none"):
        apply_fp8(model, fp8, emulate=True)
    assert apply_fp8(model, PrecisionConfig(fp8_recipe="none")) == []


@pytest.mark.parametrize("recipe", ["blockwise", "delayed"])
def test_conversion_replaces_exactly_the_filtered_modules(recipe, gen, monkeypatch):
    ao = pytest.importorskip("torchao.float8.float8_linear")
    args = tiny_args(**ALIGNED)
    plain = build(args, "sparse", gen, dtype=torch.float32)
    model = copy.deepcopy(plain)
    prec = PrecisionConfig(dtype="fp32", fp8_recipe=recipe)
    filt = fp8_module_filter(prec)
    want = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and filt(m, n)]
    params = {n: p for n, p in model.named_parameters()}
    converted = apply_fp8(model, prec, emulate=True)
    assert converted == want
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert (type(m) is ao.Float8Linear) == (n in want), n
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    assert list(model.state_dict()) == list(plain.state_dict())
    recipe_name = {"blockwise": "rowwise", "delayed": "tensorwise"}[recipe]
    assert model.layers[0].attn.wq_a.config == torchao_config(recipe, emulate=True)
    assert model.layers[0].attn.wq_a.config.cast_config_input.scaling_granularity.value == (
        "axiswise" if recipe_name == "rowwise" else "tensorwise")
    calls = []
    original = ao.Float8Linear.forward
    monkeypatch.setattr(ao.Float8Linear, "forward", lambda self, x: calls.append(self) or original(self, x))
    tokens, cu, max_len, labels = packed_batch([37, 140, 21], args.vocab_size, gen)
    want_loss = total(plain(tokens, cu, max_len, labels))
    got_loss = total(model(tokens, cu, max_len, labels))
    ids = {id(model.get_submodule(n)) for n in want}
    assert {id(m) for m in calls} == ids  # every converted module ran its FP8 forward
    assert got_loss.item() != want_loss.item()  # FP8 rounding changed the result ...
    assert abs(got_loss.item() - want_loss.item()) <= 0.05 * abs(want_loss.item())  # ... by little
    got_loss.backward()
    for n in want:
        g = model.get_submodule(n).weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, n


@pytest.mark.parametrize("fp8_dispatch", [True, False])
def test_fp8_experts_take_precision_fp8_dispatch(fp8_dispatch, gen, monkeypatch):
    """Where the routed experts run FP8 (an SM90+ GPU, bf16 compute: here the layer choice is stubbed), each MoE is
    told whether its rows cross the EP all-to-all as e4m3 (``precision.fp8_dispatch``)."""
    pytest.importorskip("torchao.float8")
    from v4launch.model.parallel import precision as precision_module

    model = build(tiny_args(**ALIGNED), "dense", gen, dtype=torch.float32)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    monkeypatch.setattr(precision_module, "_fp8_expert_layers", lambda *a: moes)
    apply_fp8(model, PrecisionConfig(fp8_recipe="blockwise", fp8_dispatch=fp8_dispatch), emulate=True)
    assert moes and all(m.fp8_experts and m.fp8_dispatch is fp8_dispatch for m in moes)
    untouched = build(tiny_args(**ALIGNED), "dense", gen, dtype=torch.float32)
    assert not any(m.fp8_experts or m.fp8_dispatch for m in untouched.modules() if isinstance(m, MoE))
