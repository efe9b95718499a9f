"""compile_blocks: every block compiled in place; same losses and gradients; names unchanged; recomputed regions
compiled inside their checkpoint (the replay takes the forward's graph)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from v4_helpers import build, packed_batch, tiny_args
from v4launch.model.compile import compile_blocks
from v4launch.model.model import Block
from v4launch.model.parallel.recompute import COMPILED_REGIONS, FULL_LAYER, apply_recompute


def _loss_and_grads(model, batch):
    out = model(*batch)
    loss = out.lm_loss + sum(out.aux_losses.values())
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), grads


def _assert_same_loss_and_grads(model, compiled, batch):
    """``compiled`` gives ``model``'s loss to 1e-12 and every gradient to 1e-10 (float64) on ``batch``."""
    loss, grads = _loss_and_grads(model, batch)
    loss2, grads2 = _loss_and_grads(compiled, batch)
    torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads2):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_compiled_blocks_match_eager(gen):
    model = build(tiny_args(n_layers=2, compress_ratios=(0, 4, 0)), "dense", gen)
    batch = packed_batch([21, 11], model.args.vocab_size, gen)
    keys = list(model.state_dict())
    loss, grads = _loss_and_grads(model, batch)
    torch._dynamo.reset()
    assert compile_blocks(model, backend="aot_eager") == 3  # 2 decoder layers + 1 MTP layer
    assert list(model.state_dict()) == keys
    loss2, grads2 = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads2):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_no_block_raises():
    with pytest.raises(ValueError, match="holds no Block"):
        compile_blocks(nn.Linear(2, 2))


def _expert_counts(model) -> list[torch.Tensor]:
    return [layer.ffn.expert_counts.clone() for layer in model.modules() if isinstance(layer, Block)]


@pytest.mark.slow
@pytest.mark.parametrize("regions", [[FULL_LAYER], ["moe"], ["layernorm", "mla_up_proj", "moe_act"]])
def test_compiled_recomputed_regions_match_eager_and_run_compiled(gen, regions):
    """Under recompute the regions' own methods are compiled (the checkpoint replays the forward's graph):
    float64 losses and gradients equal the eager model's, expert counts are counted once, and dynamo
    really compiled code (a block under whole-layer recompute is not left eager)."""
    model = build(tiny_args(n_layers=2, compress_ratios=(0, 4, 128)), "sparse", gen)
    batch = packed_batch([37, 140, 21], model.args.vocab_size, gen)
    compiled = copy.deepcopy(model)
    apply_recompute(compiled, regions)
    torch._dynamo.reset()
    counters.clear()
    assert compile_blocks(compiled, backend="aot_eager") == 3
    for module in compiled.modules():  # every recomputed region runs compiled code
        for name in getattr(type(module), "_v4_recompute_attrs", ()):
            assert name in module.__dict__[COMPILED_REGIONS]
    keys = list(model.state_dict())
    for _ in range(2):  # the second pass takes the cached graphs
        _assert_same_loss_and_grads(model, compiled, batch)
    assert counters["stats"]["unique_graphs"] > 0
    assert list(compiled.state_dict()) == keys
    for a, b in zip(_expert_counts(model), _expert_counts(compiled)):
        assert torch.equal(a, b) and a.sum() > 0  # replays put back what they counted


def test_batch_tables_as_of_hides_what_was_built_since(gen):
    """The compress plans of every ratio exist before any layer runs (built outside the compiled blocks); a
    replay sees the RoPE / plan tables as the forward did, and the later ones come back after."""
    model = build(tiny_args(n_layers=2, compress_ratios=(0, 4, 128)), "dense", gen)
    tokens, cu, max_len, labels = packed_batch([37, 140, 21], model.args.vocab_size, gen)
    ctx = model.batch_context(tokens, cu, max_len, labels)
    rope = model.layers[1].attn.rope
    before = ctx.cached_keys()
    assert before == (frozenset({4, 128}), frozenset())
    plan, tables = ctx.plan(8), ctx.cos_sin(rope, torch.float64)  # a ratio no layer has, to see it hidden
    later = ctx.cached_keys()
    with ctx.as_of(before):
        assert ctx.cached_keys() == before
        again = ctx.cos_sin(rope, torch.float64)  # built again, equal
        torch.testing.assert_close(again[0], tables[0], rtol=0, atol=0)
    assert ctx.cached_keys() == later and ctx.plan(8) is plan and ctx.cos_sin(rope, torch.float64) is tables


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_compiled_whole_layer_recompute_with_chunked_reference_attention(gen, phase):
    """Query chunks of 32 rows (the reference attention recomputes each chunk: a checkpoint nested in the
    layer's) and the indexer's cached Hadamard matrix: the replay still takes the forward's graph, on the
    first batch (which builds the caches) and on a later one of other lengths; gradients as eager."""
    model = build(tiny_args(n_layers=2, compress_ratios=(0, 4, 128)), phase, gen, chunk_size=32)
    compiled = copy.deepcopy(model)
    apply_recompute(compiled, [FULL_LAYER])
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager")
    for lengths in ([37, 140, 21], [100, 60, 38]):
        _assert_same_loss_and_grads(model, compiled, packed_batch(lengths, model.args.vocab_size, gen))


@pytest.mark.slow
def test_a_new_number_of_documents_compiles_nothing_new(gen, monkeypatch):
    """Product batches pack a different number of documents every step. Once the shapes have gone dynamic
    (three batches of 2-4 documents), batches with document counts not seen before compile no new graph: the compress plans
    (whose entry count sums over the host boundaries) are built before the compiled blocks run, so no graph
    guards on the number of documents. Without that, each new count compiled one more graph."""
    from v4launch.model import moe

    monkeypatch.setattr(moe, "grouped_mm_applies", lambda *a, **k: True)  # the GPU's sync-free expert path
    model = build(tiny_args(n_layers=2, compress_ratios=(0, 4, 0)), "dense", gen, dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, backend="aot_eager")

    def step(lengths):
        out = model(*packed_batch(lengths, model.args.vocab_size, gen))
        (out.lm_loss + sum(out.aux_losses.values())).backward()
        return counters["stats"]["unique_graphs"]

    for lengths in ([64, 64], [32, 32, 64], [16, 48, 32, 32]):
        warm = step(lengths)
    assert warm > 0
    # (one document is a size-1 dimension, which dynamo specialises: a pack of one is its own graph once)
    assert [step(lengths) for lengths in ([8, 8, 16, 32, 64], [40, 40, 48], [16] * 5 + [48])] == [warm] * 3
