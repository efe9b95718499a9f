"""compile_blocks: every block compiled in place; same losses and gradients; names unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from v4_helpers import build, packed_batch, tiny_args
from v4launch.model.compile import compile_blocks


def _loss_and_grads(model, batch):
    out = model(*batch)
    loss = out.lm_loss + sum(out.aux_losses.values())
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), grads


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
