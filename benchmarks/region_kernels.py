"""The Triton kernels inductor writes for the compiled elementwise regions at Flash width, on a machine without a GPU.

    python benchmarks/region_kernels.py                 # flash_4n widths, 65,536 rows
    python benchmarks/region_kernels.py --rows 8192 --show triton_poi_fused__to_copy_add_mul_sum_unsqueeze_0

What it does: each region of ``model/regions.py`` (the mHC mixing, RMSNorm, the per-head query norm, RoPE) is
compiled as the job compiles it (``regions.compile_rows_dynamic``) on fake tensors of the recipe's widths, with
inductor told to generate Triton code for the CPU (``cpu_backend = "triton"``) and to plan for an H200's 132 SMs;
the kernels' sources are kept instead of being compiled, so no GPU, CUDA or Triton backend is needed. Inductor's
scheduling (fusion, split reductions, loop shapes) and kernel names are those it uses on the GPU, so a kernel
named in a GPU profile can be read here (how the mHC regions' 281 ms kernel was found, 2026-12-05).

Columns: kernel, kind (``poi`` pointwise, ``red`` looped reduction, ``per`` persistent reduction), size hints
(x = outputs, r0_ = reduction length) and ``symbolic`` when its indexing uses runtime sizes (ks0, ks1, ...):
expected in the split reductions over the rows (weight and mixing-parameter gradients), anywhere else the sign
of a width left dynamic, as is a looped reduction over a handful of elements (the mHC regions compiled with every
dimension dynamic: ``red`` with r0_ = 4 and symbolic indexing over 2^30 outputs).

Relies on inductor internals (torch 2.13): a torch upgrade may break this script, never the product.
Raises: SystemExit when triton is not installed (scripts/setup.sh --kernel-tests installs it).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES: dict[str, str] = {}


def _fake_gpu_codegen() -> None:
    """Point inductor's Triton code generation at the CPU with an H200's SM count, and keep each kernel's source
    instead of compiling it."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    import torch.utils._triton as triton_utils
    from torch._inductor.runtime import hints

    inductor_config.cpu_backend = "triton"
    inductor_config.compile_threads = 1
    triton_utils.triton_hash_with_backend = lambda: "region-kernels"  # needs a driver otherwise
    create = hints.DeviceProperties.create.__func__
    hints.DeviceProperties.create = classmethod(lambda cls, device: create(cls, device)._replace(
        multi_processor_count=132))

    def keep(self, kernel_name, source_code, device_str="cuda"):
        SOURCES[kernel_name] = source_code
        return types.SimpleNamespace(run=lambda *a, **k: None, __name__=kernel_name)

    async_compile.AsyncCompile.triton = keep


def _cases(recipe, T: int):
    import torch

    from v4launch.model import common, mhc, rope

    m = recipe.model
    hc, dim, H, D, rd = m.mhc.hc_mult, m.dim, m.n_heads, m.head_dim, m.rope_head_dim
    bf16 = torch.bfloat16
    n_mix = (2 + hc) * hc

    def t(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, dtype=dtype, requires_grad=grad)

    return {
        "mHC pre (hc_pre_tail)": (mhc.hc_pre_tail, mhc.ROW_ARGS["pre"],
                                  lambda: (t(T, hc, dim, dtype=bf16), t(T, n_mix), t(3), t(n_mix), 20, 1e-6, 1e-6)),
        "mHC post (hc_post_fused)": (mhc.hc_post_fused, mhc.ROW_ARGS["post"],
                                     lambda: (t(T, dim, dtype=bf16), t(T, hc, dim, dtype=bf16), t(T, hc),
                                              t(T, hc, hc))),
        f"RMSNorm [T, {dim}]": (common.rms_norm, (0,), lambda: (t(T, dim, dtype=bf16), t(dim), 1e-6)),
        f"query norm forward [T*{H}, {D}]": (common._rms_unweighted_forward, (0,),
                                             lambda: (t(T * H, D, dtype=bf16, grad=False), 1e-6)),
        f"query norm backward [T*{H}, {D}]": (common._rms_unweighted_backward, (0, 1, 2),
                                              lambda: (t(T * H, D, dtype=bf16, grad=False),
                                                       t(T * H, 1, grad=False), t(T * H, D, dtype=bf16, grad=False))),
        f"RoPE q [T, {H}, {D}]": (rope._rotate, (0, 1, 2),
                                  lambda: (t(T, H, D, dtype=bf16), t(T, rd // 2, grad=False),
                                           t(T, rd // 2, grad=False), False)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "flash_4n.yaml"))
    ap.add_argument("--rows", type=int, default=65536, help="tokens (the regions' dim 0)")
    ap.add_argument("--show", default=None, help="print this kernel's source")
    a = ap.parse_args()
    if a.rows < 2:
        raise SystemExit(f"--rows {a.rows}: must be at least 2 (a single row specialises)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("triton is not installed: run scripts/setup.sh --kernel-tests (inductor writes Triton)") \
            from None
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    from v4launch.errors import RecipeError
    from v4launch.recipe_loading import load_recipe

    try:
        recipe = load_recipe(a.recipe).recipe
    except RecipeError as exc:
        raise SystemExit(f"--recipe {a.recipe}: {exc.message}") from None
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from v4launch.model import regions

    _fake_gpu_codegen()
    print(f"{'region / kernel':72} {'kind':4} {'size hints':34} indexing")
    for name, (fn, row_args, make) in _cases(recipe, a.rows).items():
        SOURCES.clear()
        torch._dynamo.reset()
        with FakeTensorMode(allow_non_fake_inputs=True):
            args = make()
            out = regions.compile_rows_dynamic(fn, row_args)(*args)
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
            if outs:
                sum(o.float().sum() for o in outs).backward()
        print(name)
        for kernel, src in SOURCES.items():
            hint = re.search(r"size_hints=(\{[^}]*\})", src)
            kind = kernel.split("_")[1]
            symbolic = "symbolic" if re.search(r"\bks\d+\b", src) else "static"
            print(f"  {kernel[:70]:70} {kind:4} {hint.group(1) if hint else '':34} {symbolic}")
            if a.show and kernel == a.show:
                print(src)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
