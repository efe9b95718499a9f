"""CUDA memory that libraries allocate through torch's caching allocator on first use (cuBLAS / cuBLASLt
workspaces, Triton, autograd's device thread), measured with ``torch.cuda.memory_allocated`` around the
first GEMMs of each kind, forward and backward. The memory plan counts it as a fixed term.

    python benchmarks/library_workspaces.py      # one CUDA GPU; prints bytes after each step
"""

from __future__ import annotations

import torch


def main() -> None:
    dev = torch.device("cuda")
    base = torch.cuda.memory_allocated()
    steps = []

    def mark(what: str) -> None:
        torch.cuda.synchronize()
        steps.append((what, torch.cuda.memory_allocated() - base))

    x = torch.randn(256, 256, device=dev, requires_grad=True)
    w = torch.randn(256, 256, device=dev, requires_grad=True)
    keep = [x, w]
    mark("inputs")
    keep.append(x @ w)
    mark("fp32 GEMM")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w)
    keep.append(y)
    mark("bf16 linear (autocast)")
    y.float().sum().backward()
    mark("backward (autograd device thread)")
    a = torch.randn(4, 64, 128, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4, 128, 64, device=dev, dtype=torch.bfloat16)
    keep.append(torch.bmm(a, b))
    mark("bf16 bmm")
    keep.append(torch.baddbmm(torch.zeros(4, 64, 64, device=dev), a.float(), b.float()))
    mark("fp32 baddbmm")
    own = sum(t.numel() * t.element_size() for t in keep) + sum(t.grad.numel() * 4 for t in (x, w))
    for what, n in steps:
        print(f"{what:40} {n / 2**20:8.2f} MiB allocated")
    print(f"{'tensors the script holds':40} {own / 2**20:8.2f} MiB")
    print(f"library workspaces ~ {(steps[-1][1] - own) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
