"""Any device: a CUDA model matches the CPU model (float64) and trains in bfloat16. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import build, fresh_gen, packed_batch, tiny_args
from v4launch.model import V4Model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
def test_cuda_float64_matches_cpu(phase):
    gen = fresh_gen()
    cpu = build(tiny_args(), phase, gen)
    gpu = V4Model(tiny_args(), phase).double().cuda()
    gpu.load_state_dict(cpu.state_dict(), strict=True)
    batch = packed_batch([1, 5, 133, 40], cpu.args.vocab_size, gen)
    a = cpu(*batch, return_logits=True)
    b = gpu(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in batch), return_logits=True)
    assert (a.logits - b.logits.cpu()).abs().max().item() < 1e-9
    for name, val in a.aux_losses.items():
        assert abs(val.item() - b.aux_losses[name].item()) < 1e-9, name


def test_cuda_bfloat16_trains_and_builds_indexers_on_device():
    gen = fresh_gen()
    model = V4Model(tiny_args(), "dense").cuda().bfloat16()
    model.set_phase("warmup")
    idx = model.layers[1].attn.indexer
    assert idx.wq_b.weight.is_cuda and idx.wq_b.weight.dtype == torch.bfloat16
    assert idx.compressor.ape.dtype == torch.float32
    cpu = V4Model(tiny_args(), "warmup")
    assert torch.equal(cpu.layers[1].attn.indexer.wq_b.weight.bfloat16(), idx.wq_b.weight.cpu())
    batch = [t.cuda() if isinstance(t, torch.Tensor) else t for t in packed_batch([300, 90], 61, gen)]
    out = model(*batch)
    loss = out.lm_loss + sum(out.aux_losses.values())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("mtp."))
