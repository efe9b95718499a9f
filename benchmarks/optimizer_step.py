"""The optimizer step of the job (Muon + AdamW, ``v4launch.training.optim.Optimizers``) on a recipe's model.

Times ``opt.step()`` with Newton–Schulz per matrix (``Muon.stack_elements = 1``) against stacked
same-shape matrices (the default), on the recipe's model built on the device with random gradients.
Prints a table (ms per step, median of ``--steps`` after two warm-up steps).

    python benchmarks/optimizer_step.py --recipe recipes/bench_h200.yaml --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="recipes/bench_h200.yaml")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    from v4launch.model import V4Model
    from v4launch.recipe_loading import load_recipe
    from v4launch.training.model_adapter import model_args_from_recipe
    from v4launch.training.optim import Optimizers

    recipe = load_recipe(a.recipe).recipe
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = V4Model(model_args_from_recipe(recipe), phase="sparse").to(device)
    n_muon = sum(1 for n, p in model.named_parameters() if p.ndim == 2)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {n_muon} matrices, {device}")
    for label, cap in (("per matrix", 1), ("stacked", None)):
        opt = Optimizers(model, recipe.optimizer)
        if cap is not None:
            opt.muon.stack_elements = cap
        opt.set_lr(1e-5, 1e-5)
        times = []
        for i in range(a.steps + 2):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        print(f"{label:<11} {statistics.median(times) * 1e3:8.1f} ms / optimizer step")


if __name__ == "__main__":
    main()
