"""Gradient ownership (seed 000 §3, seed 004 item 6b): which loss may reach which parameter."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import build, packed_batch, tiny_args

LENGTHS = [3, 70, 141]


def _grads(model, batch, coeff_kl: float, coeff_other: float = 1.0):
    model.zero_grad(set_to_none=True)
    out = model(*batch)
    kl = sum(v for k, v in out.aux_losses.items() if k.startswith("indexer_kl/"))
    other = sum(v for k, v in out.aux_losses.items() if not k.startswith("indexer_kl/"))
    (out.lm_loss + coeff_other * other + coeff_kl * kl).backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_kl_coefficient_does_not_touch_the_backbone(phase, gen):
    model = build(tiny_args(), phase, gen, dtype=torch.float32)
    batch = packed_batch(LENGTHS, model.args.vocab_size, gen)
    g0, g1 = _grads(model, batch, 0.0), _grads(model, batch, 1e3)
    changed = []
    for name in g0:
        if ".indexer." in name:
            continue
        assert g0[name] is not None and torch.equal(g0[name], g1[name]), name
    for name in g0:
        if ".indexer." in name and not torch.equal(g0[name], g1[name]):
            changed.append(name)
    assert changed, "the KL loss must train the indexer"


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_each_loss_reaches_exactly_its_owners(phase, gen):
    model = build(tiny_args(), phase, gen)
    batch = packed_batch(LENGTHS, model.args.vocab_size, gen)

    def grads_of(select):
        """(parameters with a gradient tensor, parameters with a nonzero gradient)."""
        model.zero_grad(set_to_none=True)
        out = model(*batch)
        select(out).backward()
        params = list(model.named_parameters())
        return ({n for n, p in params if p.grad is not None},
                {n for n, p in params if p.grad is not None and p.grad.abs().sum() > 0})

    names = {n for n, _ in model.named_parameters()}
    indexer = {n for n in names if ".indexer." in n}
    mtp = {n for n in names if n.startswith("mtp.")}
    main = names - indexer - mtp
    # an expert that drew no token this step gets a zero gradient tensor (never None)
    has, nonzero = grads_of(lambda o: o.lm_loss)
    assert has == main and len(nonzero) > 0.9 * len(main)  # all of the main model, no indexer, no MTP
    has, nonzero = grads_of(lambda o: sum(v for k, v in o.aux_losses.items() if k.startswith("indexer_kl/")))
    assert has == indexer and nonzero == indexer  # the indexer and nothing else
    has, nonzero = grads_of(lambda o: o.aux_losses["mtp/depth_1"])
    assert mtp <= has and not (has & indexer)
    assert {"embed.weight", "head.weight"} <= nonzero  # shared embed and head
    has, nonzero = grads_of(lambda o: sum(v for k, v in o.aux_losses.items() if k.startswith("balance/")))
    gates = {n for n in names if n.endswith(".ffn.gate.weight")}
    assert gates <= nonzero  # every router, hash layers included (their P term)
    assert not (has & indexer) and "head.weight" not in has and "norm.weight" not in has


def test_router_bias_and_hash_table_are_not_trained(gen):
    model = build(tiny_args(), "dense", gen)
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith("gate.bias") or n.endswith("tid2eid") for n in names)
    buffers = dict(model.named_buffers())
    assert buffers["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert "layers.1.ffn.gate.bias" in buffers and "layers.0.ffn.gate.bias" not in buffers
