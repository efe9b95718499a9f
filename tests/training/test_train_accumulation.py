"""Aux-loss scaling under gradient accumulation (seed 004 item 6c) and the loss composition."""

from __future__ import annotations

import contextlib

import torch

from v4launch.model import ModelArgs, V4Model
from v4launch.training.step import LossWeights, accumulate, compose_loss

ARGS = ModelArgs(vocab_size=264, dim=32, n_layers=3, n_mtp_layers=1, compress_ratios=(0, 4, 128, 0), n_heads=2,
                 head_dim=32, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, window_size=16,
                 index_n_heads=2, index_head_dim=32, index_topk=4, n_routed_experts=4, n_activated_experts=2,
                 moe_inter_dim=32, n_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=3)
# Large coefficients so that a missing 1/accum on any aux term would dominate the difference.
HEAVY = LossWeights(indexer_kl=5.0, balance=3.0, mtp=2.0)


def _batch(seed: int = 0):
    torch.manual_seed(seed)
    tokens = torch.randint(0, 256, (96,))
    cu = torch.tensor([0, 10, 3, 60, 23], dtype=torch.int32).cumsum(0).to(torch.int32)
    labels = torch.roll(tokens, -1)
    labels[cu[1:] - 1] = -100
    return tokens, labels, cu


class _MB:
    def __init__(self, tokens, labels, cu):
        self.tokens, self.labels, self.cu_seqlens, self.max_seqlen = tokens, labels, cu, int((cu[1:] - cu[:-1]).max())
        self.num_real_tokens = int(tokens.numel())


def _grads(model, mbs, accum):
    model.zero_grad(set_to_none=True)
    accumulate(model, mbs, accum=accum, weights=HEAVY, autocast=contextlib.nullcontext)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_1_vs_4_gives_the_same_gradients_for_every_loss_term():
    torch.manual_seed(0)
    model = V4Model(ARGS, phase="warmup").double()
    tokens, labels, cu = _batch()
    mb = _MB(tokens, labels, cu)
    once = _grads(model, [mb], accum=1)
    four = _grads(model, [mb, mb, mb, mb], accum=4)
    assert once.keys() == four.keys()
    indexer = [n for n in once if ".indexer." in n]
    assert indexer, "the KL loss must reach the indexer"
    for name in once:
        torch.testing.assert_close(four[name], once[name], rtol=1e-10, atol=1e-12, msg=name)


def test_every_aux_term_is_weighted_by_its_coefficient():
    torch.manual_seed(0)
    model = V4Model(ARGS, phase="sparse")
    tokens, labels, cu = _batch()
    out = model(tokens, cu, int((cu[1:] - cu[:-1]).max()), labels)
    kinds = {n.split("/")[0] for n in out.aux_losses}
    assert kinds == {"indexer_kl", "balance", "mtp"}
    total = compose_loss(out.lm_loss, out.aux_losses, HEAVY)
    expected = out.lm_loss + sum(getattr(HEAVY, n.split("/")[0]) * v for n, v in out.aux_losses.items())
    torch.testing.assert_close(total, expected)
