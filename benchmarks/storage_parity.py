"""Precision-aware storage against float32 storage, one training step at a time, on a recipe's model.

Two copies of the recipe's model from one seed: A keeps float32 parameters (the job's default), B stores its GEMM
weights in bf16 with the fp32 master as 16-bit remainders (``precision.params_dtype: bf16``), optionally with bf16
AdamW moments. Both run the same batches under bf16 autocast on the recipe's kernel backend, clip at 1.0 and step
the job's optimizer (``v4launch.training.optim.Optimizers``) at the recipe's learning rate for each step of its
warm-up. Per step it prints the two losses, the relative difference of the whole gradient and the parameters
whose gradient, or whose master weight after the step, differs most (relative L2 norm).

    python benchmarks/storage_parity.py --recipe recipes/bench_h200.yaml --steps 4 --tokens 4096

bf16 compute makes A and B differ by bf16 rounding only if storage is exact: gradients ~1e-2 relative (the
weight gradient is rounded to bf16 once instead of being upcast), master weights ~1e-3 after a step. A parameter
far above that is where storage changes the math.
"""

from __future__ import annotations

import argparse
import copy

import torch


def _batch(vocab: int, tokens: int, seg: int, seed: int, device: torch.device):
    """(tokens [T], cu_seqlens [N+1] int32 on the CPU, max_seqlen, labels [T]) of random ids, -100 at segment ends."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    cu = torch.arange(0, tokens + 1, seg, dtype=torch.int32)
    labels = torch.cat([ids[1:], ids.new_full((1,), -100)])
    labels[cu[1:].long() - 1] = -100
    return ids.to(device), cu, seg, labels.to(device)


def _total(out) -> torch.Tensor:
    """The LM loss plus the aux losses at the job's default weights (MTP 0.3, balance 0.01, indexer 1)."""
    return out.lm_loss + sum((1.0 if k.startswith("indexer") else 0.01 if k.startswith("balance") else 0.3) * v
                             for k, v in out.aux_losses.items())


def _masters(opt, model) -> dict[str, torch.Tensor]:
    """name -> the fp32 master of each parameter (the parameter itself where it is not stored in bf16)."""
    from v4launch.training.master_weights import master_work

    states = {}
    for o in opt.optimizers:
        for group in o.param_groups:
            for p in group["params"]:
                states[id(p)] = o.state.get(p, {})
    out = {}
    for name, p in model.named_parameters():
        st = states.get(id(p), {})
        out[name] = (master_work(p, st) if p.dtype == torch.bfloat16 and st else p.detach()).float().clone()
    return out


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], k: int) -> list[tuple[float, str]]:
    rows = []
    for name, x in a.items():
        y = b[name]
        n = float(x.norm())
        rows.append((float((x - y).norm()) / n if n else float(y.norm()), name))
    return sorted(rows, reverse=True)[:k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="recipes/bench_h200.yaml")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seg", type=int, default=2048)
    ap.add_argument("--phase", default="dense")
    ap.add_argument("--bf16-moments", action="store_true", help="B also keeps exp_avg / exp_avg_sq in bf16")
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    from v4launch.model import V4Model
    from v4launch.model.parallel.storage import apply_param_storage
    from v4launch.recipe_loading import load_recipe
    from v4launch.training.master_weights import storage_for
    from v4launch.training.model_adapter import model_args_from_recipe
    from v4launch.training.optim import Optimizers

    recipe = load_recipe(a.recipe).recipe
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    base = V4Model(model_args_from_recipe(recipe), phase=a.phase).to(dev)
    base.set_kernel_backend(recipe.attention.kernel_backend)
    prec_b = {"params_dtype": "bf16", "store_param_remainders": True}
    if a.bf16_moments:
        prec_b.update(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    runs = {}
    for label, prec in (("A fp32", {}), ("B bf16", prec_b)):
        model = copy.deepcopy(base)
        precision = recipe.precision.model_copy(update=prec)
        apply_param_storage(model, precision.params_dtype, fsdp=False)
        runs[label] = (model, Optimizers(model, recipe.optimizer, storage=storage_for(precision)))
    del base
    o = recipe.optimizer
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)
    print(f"{a.recipe}: {a.tokens} tokens per step, phase {a.phase}, kernels {recipe.attention.kernel_backend}, "
          f"B = {prec_b}")
    for step in range(1, a.steps + 1):
        batch = _batch(recipe.model.vocab_size, a.tokens, a.seg, step, dev)
        lr = o.lr * min(1.0, step / max(o.warmup_steps, 1))
        grads, masters, losses = {}, {}, {}
        for label, (model, opt) in runs.items():
            opt.zero_grad()
            with amp:
                loss = _total(model(*batch))
            loss.backward()
            grads[label] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0,
                                                  foreach=False)
            opt.set_lr(lr, o.muon_lr * lr / o.lr)
            opt.step()
            masters[label] = _masters(opt, model)
            losses[label] = (float(loss.detach()), float(norm))
        ga, gb = grads["A fp32"], grads["B bf16"]
        flat = lambda g: torch.cat([g[n].flatten() for n in sorted(ga)])  # noqa: E731
        rel = float((flat(ga) - flat(gb)).norm() / flat(ga).norm())
        print(f"step {step}: loss A {losses['A fp32'][0]:.5f} B {losses['B bf16'][0]:.5f}  grad norm A "
              f"{losses['A fp32'][1]:.4f} B {losses['B bf16'][1]:.4f}  whole-gradient rel diff {rel:.2e}")
        for r, n in _worst(ga, gb, a.top):
            print(f"    grad   {r:9.2e}  {n}  {tuple(ga[n].shape)}")
        for r, n in _worst(masters["A fp32"], masters["B bf16"], a.top):
            print(f"    master {r:9.2e}  {n}")


if __name__ == "__main__":
    main()
