"""The optimizer step of the job (Muon + AdamW, ``v4launch.training.optim.Optimizers``) on a recipe's model.

Times ``opt.step()`` with Newton–Schulz per matrix (``Muon.stack_elements = 1``) against stacked
same-shape matrices (the default), on the recipe's model built on the device with random gradients.
Prints a table (ms per step, median of ``--steps`` after two warm-up steps); ``--storage`` adds a row with
precision-aware storage (``precision.params_dtype: bf16`` with remainders and bf16 moments) and, on a GPU, the
memory the weights, gradients and optimizer state hold after a step and the step's own transient.

    python benchmarks/optimizer_step.py --recipe recipes/bench_h200.yaml --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _rows(storage: bool) -> list[tuple[str, int | None, dict]]:
    """(label, Muon stack cap, precision overrides) of each row."""
    rows = [("per matrix", 1, {}), ("stacked", None, {})]
    if storage:
        rows.append(("bf16 storage", None, {"params_dtype": "bf16", "store_param_remainders": True,
                                            "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="recipes/bench_h200.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--storage", action="store_true", help="add a row with precision-aware storage (bf16 GEMM weights "
                    "with 16-bit remainders, bf16 moments) and print the training state's GiB per row")
    a = ap.parse_args()
    from v4launch.model import V4Model
    from v4launch.model.parallel.storage import apply_param_storage
    from v4launch.recipe_loading import load_recipe
    from v4launch.training.master_weights import storage_for
    from v4launch.training.model_adapter import model_args_from_recipe
    from v4launch.training.optim import Optimizers

    recipe = load_recipe(a.recipe).recipe
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for label, cap, prec in _rows(a.storage):
        precision = recipe.precision.model_copy(update=prec)
        torch.manual_seed(0)
        model = V4Model(model_args_from_recipe(recipe), phase="sparse").to(device)
        apply_param_storage(model, precision.params_dtype, fsdp=False)
        if label == "per matrix":
            n_muon = sum(1 for n, p in model.named_parameters() if p.ndim == 2)
            print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {n_muon} matrices, {device}")
        opt = Optimizers(model, recipe.optimizer, storage=storage_for(precision))
        if cap is not None:
            opt.muon.stack_elements = cap
        opt.set_lr(1e-5, 1e-5)
        times, held = [], 0
        for i in range(a.steps + 2):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated()
                transient = torch.cuda.max_memory_allocated() - before
            if i >= 2:
                times.append(time.perf_counter() - t0)
        mem = (f"   state {held / 2**30:6.2f} GiB (weights + grads + optimizer), step transient "
               f"{transient / 2**30:5.2f} GiB" if device.type == "cuda" else "")
        print(f"{label:<13} {statistics.median(times) * 1e3:8.1f} ms / optimizer step{mem}", flush=True)
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
