"""Static batch tables (``V4Model.batch_context(..., static_seqlen=S)``, ``packing.pad_pack``): the shapes a
CUDA-graph-captured step needs. The losses and every gradient must equal those of the exact tables, for
random packings, in every phase, on the reference attention and on the fused-kernel layer (over the
reference functions as a stand-in backend, as on CPU there is no Triton GPU); and a context loaded with
another batch's tables (``BatchContext.load``, what a graph replay runs on) must give that batch's result.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from v4_helpers import build, fresh_gen, packed_batch, tiny_args
from v4launch.model.packing import compress_plan, make_pack, pad_pack

T, SEQ = 96, 48  # two rows of 48 tokens, as the loader packs a micro-batch of 2 x seq_len
TOPK = SEQ // 4
"""Every entry a row can see (ratio 4): top-k then selects all visible entries. With a smaller k the exact and the
static tables may pick different entries among TIED indexer scores (relu makes exact zeros common; torch.topk
breaks ties by position, and the static plan's width differs): both are top-k, but the losses jump. Which
entries each row may see is compared directly below (``first`` / ``n_visible``)."""


def _random_lengths(gen: torch.Generator) -> list[int]:
    """Segments of one micro-batch of two rows: documents of 1..48 tokens, each row filled to SEQ."""
    out = []
    for _ in range(T // SEQ):
        left = SEQ
        while left:
            n = min(left, int(torch.randint(1, SEQ + 1, (1,), generator=gen)))
            out.append(n)
            left -= n
    return out


def _losses_and_grads(model, tokens, labels, ctx) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model.forward_in(ctx, tokens, labels)
    total = out.lm_loss + sum(out.aux_losses.values())
    total.backward()
    got = {"lm_loss": out.lm_loss.detach(), **{k: v.detach() for k, v in out.aux_losses.items()}}
    got.update({f"grad/{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return got


def _stand_in_triton(monkeypatch, dense_kl_fused: bool = False):
    """The reference functions under the triton name; ``dense_kl_fused``: the warm-up KL through
    ``layer._DenseKL`` (on a static batch: ``layer.static_chunks``, no host read)."""
    from v4launch.model import model as model_module
    from v4launch.model.kernels import dispatch

    stand_in = dataclasses.replace(dispatch.select_backend("reference", "cpu"), name="triton",
                                   dense_kl_fused=lambda *a: dense_kl_fused)
    monkeypatch.setattr(model_module, "select_backend", lambda name, device: stand_in)


@pytest.mark.parametrize("backend,phase", [(b, p) for b in ("reference", "fused-layer")
                                           for p in ("dense", "warmup", "sparse")] + [("fused-kl", "warmup")])
def test_static_tables_give_the_exact_losses_and_gradients(phase, backend, monkeypatch):
    gen = fresh_gen()
    if backend != "reference":
        _stand_in_triton(monkeypatch, dense_kl_fused=backend == "fused-kl")
    kw = {"kernel_backend": "triton"} if backend != "reference" else {}
    model = build(tiny_args(index_topk=TOPK), phase, gen, **kw)
    lengths = _random_lengths(gen)
    tokens, cu, max_seqlen, labels = packed_batch(lengths, model.args.vocab_size, gen)
    exact = _losses_and_grads(model, tokens, labels, model.batch_context(tokens, cu, max_seqlen, labels))
    static_ctx = model.batch_context(tokens, cu, max_seqlen, labels, static_seqlen=SEQ)
    assert static_ctx.pack.n_segments == T and static_ctx.pack.max_seqlen == SEQ
    assert all(p.n_entries == T // r for r, p in static_ctx._plans.items())
    static = _losses_and_grads(model, tokens, labels, static_ctx)
    assert exact.keys() == static.keys()
    assert any(k.startswith("balance/") for k in exact)
    assert (phase == "dense") != any(k.startswith("indexer") for k in exact)
    for name in exact:
        torch.testing.assert_close(static[name], exact[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_a_loaded_context_runs_the_other_batch(monkeypatch):
    """What a replay does: tables captured for batch A, batch B's copied in; B's losses and gradients."""
    gen = fresh_gen()
    _stand_in_triton(monkeypatch)
    model = build(tiny_args(index_topk=TOPK), "sparse", gen, kernel_backend="triton")
    a = packed_batch(_random_lengths(gen), model.args.vocab_size, gen)
    b = packed_batch(_random_lengths(gen), model.args.vocab_size, gen)
    held = model.batch_context(*a, static_seqlen=SEQ)
    tokens, labels = a[0].clone(), a[3].clone()  # the static token buffers
    _losses_and_grads(model, tokens, labels, held)  # fills the RoPE tables of A, which load must drop
    held.load(model.batch_context(*b, static_seqlen=SEQ))
    tokens.copy_(b[0])
    labels.copy_(b[3])
    replayed = _losses_and_grads(model, tokens, labels, held)
    expected = _losses_and_grads(model, b[0], b[3], model.batch_context(*b))
    for name in expected:
        torch.testing.assert_close(replayed[name], expected[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")


def test_load_refuses_another_static_shape():
    gen = fresh_gen()
    model = build(tiny_args(), "sparse", gen)
    a = packed_batch([SEQ, SEQ], model.args.vocab_size, gen)
    b = packed_batch([SEQ, SEQ, SEQ], model.args.vocab_size, gen)
    held = model.batch_context(*a, static_seqlen=SEQ)
    with pytest.raises(ValueError, match="not the same static batch shape"):
        held.load(model.batch_context(*b, static_seqlen=SEQ))
    with pytest.raises(ValueError, match="longest segment"):
        model.batch_context(*packed_batch([SEQ + 1, SEQ - 1], model.args.vocab_size, gen), static_seqlen=SEQ)


def test_static_compress_plan_keeps_the_real_entries_and_hides_the_rest():
    gen = fresh_gen()
    for _ in range(20):
        lengths = _random_lengths(gen)
        tokens, cu, _, _ = packed_batch(lengths, 7, gen)
        pack = make_pack(tokens, cu, SEQ)
        padded = pad_pack(pack, T, SEQ)
        assert padded.lengths[len(lengths):].eq(0).all() and padded.cu[-1] == T
        for ratio in (4, 128):
            exact, static = compress_plan(pack, ratio), compress_plan(padded, ratio, T // ratio)
            c = exact.n_entries
            assert static.n_entries == T // ratio >= c
            for field in ("start", "pos", "has_prev"):
                assert torch.equal(getattr(static, field)[:c], getattr(exact, field)), field
            assert torch.equal(static.seg_offset[:len(lengths)], exact.seg_offset)
            assert torch.equal(static.n_visible, exact.n_visible)
            assert not static.has_prev[c:].any() and static.start[c:].eq(0).all()
            # no query sees an entry past the real ones
            reach = static.seg_offset[padded.seg] + static.n_visible
            assert int(reach.max()) <= c
    with pytest.raises(ValueError, match="must hold the batch"):
        pad_pack(make_pack(*packed_batch([10, 20], 7, gen)[:2], 20), 1, 20)
