"""Measured GPU memory of V4-Flash-width layers beside the memory plan's figure (V4-MEMORY calibration).

    python benchmarks/memory_calibration.py --plan-only                       # the plan's figures, any machine
    python benchmarks/memory_calibration.py --json $OUT/memory_calibration.json   # one H200

Each row: Flash widths (dim 4096, 64 heads x 512, q_lora 1024, 8 output groups, 6 of 16 routed experts + 1
shared, moe_inter 2048, vocab 129,280, no MTP), L decoder layers alternating CSA (ratio 4) / HCA (ratio
128), one packed sequence of T tokens in the sparse phase on the Triton kernels, bf16 autocast over fp32
parameters, with the row's ``parallel.recompute_granularity`` applied by the job's seam
(``model/parallel/recompute.py``). Two iterations of forward + backward with the gradients set to None
between them (as the job's step does); no optimizer. Measured: ``params`` = ``torch.cuda.memory_allocated``
before the first forward; ``saved`` = allocated after the second forward minus params; ``peak`` =
``torch.cuda.max_memory_allocated`` over the second iteration minus params. The plan's figure is
``MemoryPlan.allocated_bytes`` minus its optimizer term (what ``max_memory_allocated`` sees, without the
optimizer) for the same recipe; ``error`` = plan / measured - 1. The rows are kept in
tests/validators/memory_h200.json, where ``test_memory_plan.py`` holds the plan to them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT.parent))

FLASH_WIDTHS = {
    "vocab_size": 129280, "dim": 4096, "mtp": {"depth": 0}, "n_heads": 64, "head_dim": 512, "q_lora_rank": 1024,
    "o_groups": 8, "o_lora_rank": 1024,
    "moe": {"n_routed_experts": 16, "n_activated_experts": 6, "n_shared_experts": 1, "moe_inter_dim": 2048,
            "n_hash_layers": 0},
}
"""The model section of every row (tests/validators/memory_h200.json ``model``)."""

ROWS = [("none", 2, 8192), ("none", 2, 32768), ("full", 2, 65536), ("full", 4, 65536), ("full", 8, 65536),
        ("none", 2, 65536)]
"""(recompute_granularity, L, T) measured by default; the last runs out of memory on an H200, as planned (a
128K-token Flash-width layer does not fit one H200 even recomputed)."""


OPTIONS = {"": {}, "bf16": {"precision": {"params_dtype": "bf16"}},
           "offload": {"parallel": {"cpu_offloading": True}},
           "bf16+offload": {"precision": {"params_dtype": "bf16"}, "parallel": {"cpu_offloading": True}}}
"""A row's storage / offload option (the 4th field of ``--rows``): bf16 GEMM weights (precision.params_dtype; one
GPU, no FSDP: every matrix), the layer inputs in host memory (parallel.cpu_offloading, whole-layer recompute)."""


def recipe_for(granularity: str, layers: int, tokens: int, phase: str = "sparse", path: str = "triton",
               option: str = ""):
    """The recipe whose stage 0 is the row (validated by the schema, not by the rules)."""
    from v4launch.validators.schema.recipe import Recipe

    model = {**FLASH_WIDTHS, "n_layers": layers, "compress_ratios": [4, 128] * (layers // 2),
             "max_position_embeddings": max(tokens, 65536)}
    extra = OPTIONS[option]
    return Recipe.model_validate({
        "name": "measured", "model": model, "attention": {"kernel_backend": path, "kl_chunk_size": 1024},
        "parallel": {"recompute_granularity": granularity, **extra.get("parallel", {})},
        "precision": extra.get("precision", {}),
        "cluster": {"gpu": "H200", "nodes": 1, "gpus_per_node": 1},
        "curriculum": {"stages": [{"name": "s", "seq_len": tokens, "phase": phase, "steps": 1}]}})


def planned_bytes(recipe) -> int:
    """The plan's allocated bytes of stage 0 without the optimizer term."""
    from v4launch.validators.memory_plan import memory_plan

    plan = memory_plan(recipe, 0)
    return plan.allocated_bytes - plan.term("optimizer").bytes


def measure(recipe) -> dict:
    """params / saved / peak bytes of two forward + backward iterations on the current CUDA device."""
    import torch

    from v4launch.model import V4Model
    from v4launch.model.parallel.recompute import apply_recompute, modules_from_recipe
    from v4launch.training.model_adapter import model_args_from_recipe

    st = recipe.curriculum.stages[0]
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = V4Model(model_args_from_recipe(recipe), phase=st.phase, chunk_size=recipe.attention.kl_chunk_size,
                    kernel_backend=recipe.attention.kernel_backend).to(device)
    apply_recompute(model, modules_from_recipe(recipe.parallel.recompute_granularity, recipe.parallel.recompute_modules))
    if recipe.parallel.cpu_offloading:
        from v4launch.model.parallel.offload import apply_activation_offload

        apply_activation_offload(model)
    from v4launch.model.parallel.storage import apply_param_storage

    apply_param_storage(model, recipe.precision.params_dtype, fsdp=False)
    T = st.seq_len
    tokens = torch.randint(0, recipe.model.vocab_size, (T,), device=device)
    labels = torch.randint(0, recipe.model.vocab_size, (T,), device=device)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    torch.cuda.synchronize()
    params = torch.cuda.memory_allocated()
    out = {}
    for it in range(2):
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            res = model(tokens, cu, T, labels)
            loss = res.lm_loss + sum(res.aux_losses.values())
        torch.cuda.synchronize()
        saved = torch.cuda.memory_allocated() - params
        loss.backward()
        torch.cuda.synchronize()
        out = {"params": params, "saved": saved, "peak": torch.cuda.max_memory_allocated() - params}
    del model, res, loss
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="*", default=None,
                    help="granularity:L:T[:option] entries, option one of " + ", ".join(o for o in OPTIONS if o)
                         + " (default: ROWS)")
    ap.add_argument("--plan-only", action="store_true", help="print the plan's figures, measure nothing")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rows = [(g, int(L), int(T), *opt) for g, L, T, *opt in (r.split(":") for r in a.rows)] if a.rows else ROWS
    gib = float(1 << 30)
    results = []
    print(f"{'recompute':9} {'L':>2} {'T':>7} {'plan GiB':>9} {'measured GiB':>13} {'error':>7}")
    for granularity, layers, tokens, *opt in rows:
        option = opt[0] if opt else ""
        recipe = recipe_for(granularity, layers, tokens, option=option)
        planned = planned_bytes(recipe)
        row = {"phase": "sparse", "path": "triton", "recompute": granularity, "L": layers, "T": tokens,
               "plan": planned, **({"option": option} if option else {})}
        if not a.plan_only:
            try:
                row.update(measure(recipe))
            except Exception as exc:  # an out-of-memory row is reported, the others still run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        measured = row["params"] + row["peak"] if "peak" in row else None
        err = f"{planned / measured - 1:+.1%}" if measured else row.get("error", "-")[:40]
        print(f"{granularity + (':' + option if option else ''):9} {layers:>2} {tokens:>7} {planned / gib:9.2f} "
              f"{(measured or 0) / gib:13.2f} {err:>7}", flush=True)
        results.append(row)
        if a.json:  # after every row: a later row may run out of memory or out of time
            import torch

            meta = {"what": __doc__.split("\n\n")[2].replace("\n", " "), "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "model": FLASH_WIDTHS, "rows": results}
            a.json.write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
