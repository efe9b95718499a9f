"""Chunked LM head + cross entropy (model/loss.py) against F.cross_entropy of the plain product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from v4_helpers import build, packed_batch, tiny_args
from v4launch.model.loss import HeadLogits, chunk_rows_for, head_cross_entropy


def _case(gen, T=11, d=16, V=29, dtype=torch.float64):
    hidden = torch.randn(T, d, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, d, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[torch.randperm(T, generator=gen)[:3]] = -100
    labels[3:6] = -100  # with chunk_rows=3, one whole chunk is ignored
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def _reference(hidden, weight, labels):
    """The plain product and torch's cross entropy, summed over labels != -100."""
    return F.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk_rows", [1, 3, 4, None])
def test_float64_value_and_gradients_match_the_plain_product(gen, chunk_rows):
    hidden, weight, labels = _case(gen)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    got = head_cross_entropy(hidden, weight, labels, chunk_rows)
    ref = _reference(h2, w2, labels)
    torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13)
    g = torch.rand((), generator=gen, dtype=torch.float64) + 0.5  # a non-unit upstream gradient
    dh, dw = torch.autograd.grad(got, (hidden, weight), g)
    rh, rw = torch.autograd.grad(ref, (h2, w2), g)
    torch.testing.assert_close(dh, rh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-12, atol=1e-12)


def test_no_valid_label_gives_zero_with_a_graph(gen):
    hidden, weight, labels = _case(gen)
    loss = head_cross_entropy(hidden, weight, torch.full_like(labels, -100), 4)
    assert loss.item() == 0.0
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    assert not dh.any() and not dw.any()


def test_bf16_is_the_float32_accumulated_loss_of_the_bf16_operands(gen):
    hidden, weight, labels = _case(gen, T=13, d=32, V=41, dtype=torch.float64)
    hb = hidden.detach().to(torch.bfloat16).requires_grad_()
    wf = weight.detach().float().requires_grad_()  # float32 head weight, bf16 activations
    got = head_cross_entropy(hb, wf, labels, 5)
    assert got.dtype == torch.float32
    h64, w64 = hb.detach().double().requires_grad_(), wf.detach().to(torch.bfloat16).double().requires_grad_()
    ref = _reference(h64, w64, labels)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    got.backward()
    ref.backward()
    assert hb.grad.dtype == torch.bfloat16 and wf.grad.dtype == torch.float32
    # the backward GEMMs read the softmax gradient in bf16: bf16 rounding, relative to the gradient's size
    for a, b in ((hb.grad, h64.grad), (wf.grad, w64.grad)):
        assert (a.double() - b).norm() <= 1e-2 * b.norm()


def test_bad_shapes_and_chunk_raise(gen):
    hidden, weight, labels = _case(gen)
    with pytest.raises(ValueError, match="labels"):
        head_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="chunk_rows=0"):
        head_cross_entropy(hidden, weight, labels, 0)
    assert chunk_rows_for(129280) == 2076 and chunk_rows_for(1 << 40) == 1


def test_model_losses_use_the_fused_head_and_return_logits_still_works(gen):
    """lm_loss and the MTP loss equal torch's cross entropy of the materialised float64 logits."""
    model = build(tiny_args(), "dense", gen)
    tokens, cu, max_seqlen, labels = packed_batch([13, 7], model.args.vocab_size, gen)
    out = model(tokens, cu, max_seqlen, labels, return_logits=True)
    assert out.logits.shape == (20, model.args.vocab_size) and out.logits.dtype == torch.float64
    ref = F.cross_entropy(out.logits, labels, ignore_index=-100)
    torch.testing.assert_close(out.lm_loss, ref, rtol=1e-12, atol=1e-12)
    hidden = torch.randn(20, model.args.dim, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(HeadLogits(hidden, model.head.weight).materialize(), hidden @ model.head.weight.t())


def test_switching_the_fused_head_off_gives_the_same_loss(gen):
    from v4launch.model import loss as loss_mod

    hidden, weight, labels = _case(gen)
    fused = HeadLogits(hidden, weight).cross_entropy(labels)
    loss_mod.set_fused_head(False)
    try:
        plain = HeadLogits(hidden, weight).cross_entropy(labels)
    finally:
        loss_mod.set_fused_head(True)
    torch.testing.assert_close(fused, plain, rtol=1e-13, atol=1e-13)


class _CountingRows:
    """The PyTorch row passes (kernels.reference), counting the calls of each."""

    def __init__(self):
        from v4launch.model.kernels import reference

        self.reference, self.calls = reference, {"logsumexp_target": 0, "softmax_grad": 0}

    def logsumexp_target(self, z, labels):
        self.calls["logsumexp_target"] += 1
        return self.reference.logsumexp_target(z, labels)

    def softmax_grad(self, *args):
        self.calls["softmax_grad"] += 1
        return self.reference.softmax_grad(*args)


def test_gradients_are_formed_in_the_forward_and_only_when_needed(gen):
    """With grad on: one softmax gradient per chunk in the forward, none in the backward (no logits are
    recomputed). Under no_grad, or with frozen inputs: none at all, and only the needed gradient exists."""
    hidden, weight, labels = _case(gen)
    rows = _CountingRows()
    loss = head_cross_entropy(hidden, weight, labels, 4, kernels=rows)  # 11 rows: 3 chunks
    assert rows.calls == {"logsumexp_target": 3, "softmax_grad": 3}
    loss.backward()
    assert rows.calls == {"logsumexp_target": 3, "softmax_grad": 3}
    rows = _CountingRows()
    with torch.no_grad():
        frozen = head_cross_entropy(hidden, weight, labels, 4, kernels=rows)
    assert rows.calls == {"logsumexp_target": 3, "softmax_grad": 0}
    torch.testing.assert_close(frozen, loss.detach(), rtol=0, atol=0)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone()  # frozen head weight
    head_cross_entropy(h2, w2, labels, 4).backward()
    ref_h = hidden.detach().clone().requires_grad_()
    _reference(ref_h, w2, labels).backward()
    assert w2.grad is None
    torch.testing.assert_close(h2.grad, ref_h.grad, rtol=1e-12, atol=1e-12)


def test_two_heads_on_one_weight_accumulate_its_gradient(gen):
    """The MTP head's loss and the main head's share the head weight (spec §3 "MTP"): both gradients,
    formed in each forward and scaled by different upstream weights, add up in ``weight.grad``."""
    hidden, weight, labels = _case(gen)
    hidden_mtp = torch.randn_like(hidden).requires_grad_()
    a, b = torch.rand(2, generator=gen, dtype=torch.float64) + 0.25
    main, mtp = head_cross_entropy(hidden, weight, labels, 3), head_cross_entropy(hidden_mtp, weight, labels, 5)
    (a * main + b * mtp).backward()
    h_ref, hm_ref = hidden.detach().clone().requires_grad_(), hidden_mtp.detach().clone().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    (a * _reference(h_ref, w_ref, labels) + b * _reference(hm_ref, w_ref, labels)).backward()
    for got, ref in ((hidden.grad, h_ref.grad), (hidden_mtp.grad, hm_ref.grad), (weight.grad, w_ref.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
