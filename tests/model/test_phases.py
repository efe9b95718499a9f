"""Dense mode, warm-up and sparse mode build the intended graphs (seed 000 §2)."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import build, packed_batch, tiny_args
from v4launch.model import V4Model


def test_dense_has_no_indexer_and_attends_all_visible(gen):
    model = build(tiny_args(), "dense", gen)
    assert not model.has_indexer
    assert not any(".indexer." in n for n in model.state_dict())
    out = model(*packed_batch([40], model.args.vocab_size, gen))
    assert not any(k.startswith("indexer_kl/") for k in out.aux_losses)


def test_set_phase_builds_indexers_once_and_only_forward(gen):
    args = tiny_args()
    model = build(args, "dense", gen, dtype=torch.float32)
    model.set_phase("dense")  # staying put is allowed
    model.set_phase("warmup")
    assert model.has_indexer
    csa = [i for i, r in enumerate(args.compress_ratios) if r == 4]
    names = {n for n in model.state_dict() if ".indexer." in n}
    assert {int(n.split(".")[1]) for n in names if n.startswith("layers.")} == set(csa)
    p = model.layers[1].attn.indexer.wq_b.weight
    assert p.dtype == torch.float32 and model.layers[1].attn.indexer.compressor.ape.dtype == torch.float32
    # indexers are seeded: every rank (or a rebuilt model) draws the same ones
    other = build(args, "dense", torch.Generator().manual_seed(1), dtype=torch.float32)
    other.set_phase("warmup")
    assert torch.equal(other.layers[1].attn.indexer.wq_b.weight, p)
    model.set_phase("sparse")
    assert model.layers[1].attn.indexer.wq_b.weight is p  # not rebuilt
    with pytest.raises(ValueError, match="phases only move forward"):
        model.set_phase("warmup")
    with pytest.raises(ValueError, match="phases only move forward"):
        model.set_phase("dense")


def test_warmup_and_sparse_share_the_main_graph_but_not_the_kl_target(gen):
    args = tiny_args(index_topk=2)
    warm = build(args, "warmup", gen)
    sparse = V4Model(args, "sparse").double()
    sparse.load_state_dict(warm.state_dict(), strict=True)
    batch = packed_batch([90, 60], args.vocab_size, gen)
    with torch.no_grad():
        a, b = warm(*batch, return_logits=True), sparse(*batch, return_logits=True)
    assert torch.equal(a.logits, b.logits)  # both use sparse (top-k) main attention
    assert a.lm_loss.item() == b.lm_loss.item()
    kl_a, kl_b = a.aux_losses["indexer_kl/layer_01"], b.aux_losses["indexer_kl/layer_01"]
    assert kl_a.item() != kl_b.item()  # dense teacher over all visible vs the selected set
    dense = V4Model(args, "dense").double()
    missing = dense.load_state_dict(warm.state_dict(), strict=False)
    assert missing.unexpected_keys and all(".indexer." in k for k in missing.unexpected_keys)
    with torch.no_grad():
        c = dense(*batch, return_logits=True)
    assert not torch.allclose(c.logits, a.logits)  # dense mode attends every visible entry


def test_sparse_selection_is_bounded_by_topk(gen, monkeypatch):
    """In sparse mode each query's compressed candidates are at most index_topk entries."""
    from v4launch.model import attention as attention_mod

    args = tiny_args(index_topk=2)
    model = build(args, "sparse", gen)
    seen = []
    real = attention_mod.select_topk

    def spy(*a, **k):
        idx, valid = real(*a, **k)
        seen.append(valid.sum(1).max().item())
        return idx, valid

    monkeypatch.setattr(attention_mod, "select_topk", spy)
    with torch.no_grad():
        model(*packed_batch([64], args.vocab_size, gen))
    assert seen and max(seen) == 2
