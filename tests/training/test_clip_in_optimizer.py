"""The global-norm clip applied by ``Optimizers.step(clip=...)``: folded into a fused AdamW as its ``grad_scale``
(no separate pass over the gradients), multiplied in place for Muon and a non-fused AdamW; every path gives the
update of the optimizer on the clipped gradients: the reference is ``torch.nn.utils.clip_grad_norm_`` on a copy,
then the same optimizers unfused (foreach), on fresh random weights and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from v4launch.model.parallel.data_parallel import clip_coefficient, clip_grad_norm, grad_norm
from v4launch.training.optim import Optimizers
from v4launch.validators.schema import OptimizerConfig


class _Net(torch.nn.Module):
    """Hidden matrices (Muon under muon_adamw), a norm gain and an embedding (AdamW)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8, dtype=dtype)
        self.wq = torch.nn.Linear(8, 12, bias=False, dtype=dtype)
        self.wo = torch.nn.Linear(12, 8, bias=False, dtype=dtype)
        self.attn_norm = torch.nn.RMSNorm(8, dtype=dtype)


def _with_grads(dtype: torch.dtype, gen: torch.Generator, spread: float) -> _Net:
    net = _Net(dtype)
    for p in net.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=dtype)
        p.grad = torch.randn(p.shape, generator=gen, dtype=dtype) * spread
    return net


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the fused CUDA kernel)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("name", ["adamw", "muon_adamw"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("spread", [30.0, 1e-3])  # clipped, and below the threshold (coefficient exactly 1)
def test_clip_in_step_equals_clip_then_step(name, fused, spread, device):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    net = _with_grads(torch.float32, gen, spread).to(device)
    for p in net.parameters():
        p.grad = p.grad.to(device)
    ref = copy.deepcopy(net)
    for p, q in zip(net.parameters(), ref.parameters()):
        q.grad = p.grad.clone()
    cfg = OptimizerConfig(name=name, lr=1e-2, muon_lr=1e-2, weight_decay=0.1)
    opt = Optimizers(net, cfg, muon_ns_dtype=torch.float32, fused=fused)
    ref_opt = Optimizers(ref, cfg, muon_ns_dtype=torch.float32, fused=False)
    max_norm = 1.0

    # reference: torch's own clip on the same gradients, then the plain (foreach) step
    ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters()], max_norm, foreach=False)
    ref_opt.step()

    norm = grad_norm(list(net.parameters()))
    counter = _CountOps()
    with counter:
        opt.step(clip=clip_coefficient(norm, max_norm))
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=2e-6, msg=n)
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-6, atol=1e-9, msg=n)  # p.grad holds the clipped gradient
    # the fold: a fused AdamW optimising everything multiplies no gradient beforehand
    muls = counter.names.count("_foreach_mul_")
    if fused and name == "adamw":
        assert muls == 0 and "_fused_adamw_" in counter.names
    else:
        assert muls >= 1


def test_clip_grad_norm_keeps_torchs_rule_in_float64():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    net = _with_grads(torch.float64, gen, 10.0)
    grads = [p.grad.clone() for p in net.parameters()]
    expect = torch.sqrt(sum((g * g).sum() for g in grads))
    norm = clip_grad_norm(net.parameters(), 0.5)
    torch.testing.assert_close(norm, expect)
    coef = min(1.0, 0.5 / (expect.item() + 1e-6))
    for p, g in zip(net.parameters(), grads):
        torch.testing.assert_close(p.grad, g * coef)
    assert clip_coefficient(torch.tensor(0.1, dtype=torch.float64), 0.5).item() == 1.0
