"""benchmarks/flash_width.py on the CPU (``--tiny``): the script runs end to end, its rows describe the one-rank
shape it claims, the "layers alone" line is the difference it says, kernel names land in the intended regions,
and a bad ``--rows`` entry is refused with the rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "flash_width.py"


def _module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import flash_width
    finally:
        sys.path.pop(0)
    return flash_width


def test_tiny_cpu_run_writes_rows_and_the_layer_difference(tmp_path):
    out = tmp_path / "fw.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--rows", "sparse:2", "sparse:4",
                           "dense:2", "sparse:2:fp8", "--profile", "sparse:2", "--sites", "--warmup", "0", "--iters", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    fp8 = [r for r in data["rows"] if r["precision"] == "fp8"]
    assert len(fp8) == 1 and "error" not in fp8[0] and fp8[0]["loss"] == fp8[0]["loss"]  # torchao's CPU emulation
    rows = {(r["phase"], r["layers"]): r for r in data["rows"] if r["precision"] == "bf16"}
    assert set(rows) == {("sparse", 2), ("sparse", 4), ("dense", 2)}
    for r in rows.values():
        assert "error" not in r, r
        assert r["tokens"] == 256 and r["ms"] > 0 and r["flops"] > 0 and r["loss"] == r["loss"]  # not NaN
        assert r["local_experts"] >= 1 and 1 <= r["top_k"] <= r["local_experts"]
    assert rows["sparse", 4]["flops"] > rows["sparse", 2]["flops"]
    (pair,) = [x for x in data["layers"] if x["phase"] == "sparse"] or [None]
    if pair is not None:  # printed only when the 4-layer row was the slower one (wall clock on a shared CPU)
        lo, hi = rows["sparse", 2], rows["sparse", 4]
        assert pair["layer_ms"] == pytest.approx((hi["ms"] - lo["ms"]) / 2)
        assert pair["layer_flops"] == pytest.approx((hi["flops"] - lo["flops"]) / 2)
    assert [p["phase"] for p in data["profiles"]] == ["sparse"]
    sites = data["profiles"][0]["sites"]  # --sites: time per model function, most first
    assert [s["ms"] for s in sites] == sorted((s["ms"] for s in sites), reverse=True)
    assert any(s["site"].startswith("model/mhc.py:") for s in sites) and all(s["ms"] > 0 and s["ops"] for s in sites)
    assert "sparse" in proc.stdout and "TFLOP/s" in proc.stdout
    assert all(r["backend_used"] == "reference" and r["backend_note"] for r in rows.values())  # triton: not on a CPU
    assert "using the reference kernels" in proc.stdout and "no GPU kernels (CPU run)" in proc.stdout


def test_compile_option_compiles_the_blocks_as_the_job_does():
    """``--compile``: build() hands the model to ``compile_blocks`` after the recompute wrappers, so under the
    recipe's whole-layer recompute each block's recomputed forward is the compiled region (as compile.enable
    does in the job; the compiled blocks' numbers are tests/model/test_compile_blocks.py's)."""
    import torch

    from v4launch.model.parallel.recompute import COMPILED_REGIONS

    fw = _module()
    recipe, _ = fw.bench_recipe(str(REPO / "recipes" / "flash_4n.yaml"), 0, "sparse", 2, None, "triton", True)
    eager, _ = fw.build(recipe, torch.device("cpu"))
    compiled, _ = fw.build(recipe, torch.device("cpu"), "aot_eager")
    regions = [m.__dict__[COMPILED_REGIONS] for m in compiled.modules() if COMPILED_REGIONS in m.__dict__]
    assert len(regions) == 2 and all("forward" in r for r in regions)  # the two decoder layers
    assert not any(COMPILED_REGIONS in m.__dict__ for m in eager.modules())


def test_bench_recipe_gives_one_ep_rank_its_experts():
    """flash_4n: 256 routed experts over EP32 -> 8 on the rank, top-6; the stage's 65,536 tokens; one GPU."""
    fw = _module()
    recipe, shape = fw.bench_recipe(str(REPO / "recipes" / "flash_4n.yaml"), 0, "sparse", 4, None, "triton", False)
    assert shape == {"ep": 32, "local_experts": 8, "top_k": 6, "tokens": 65536}
    m, p = recipe.model, recipe.parallel
    assert (m.n_layers, list(m.compress_ratios), m.mtp.depth) == (4, [4, 128, 4, 128], 0)
    assert (m.moe.n_routed_experts, m.moe.n_activated_experts, m.moe.n_hash_layers) == (8, 6, 0)
    assert (m.dim, m.n_heads, m.head_dim, m.indexer.n_heads) == (4096, 64, 512, 64)
    assert (p.ep, p.cp, p.pp, recipe.cluster.world_size) == (1, 1, 1, 1)
    assert recipe.precision.params_dtype == "bf16" and p.recompute_granularity == "full"


@pytest.mark.parametrize("kernel, region", [
    ("_student_bwd_keys", "KL teacher + student"),
    ("_sparse_fwd", "attention fwd"),
    ("_dkv_block_pass", "attention bwd"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblemShape",
     "MoE grouped GEMMs"),
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_badd_coopA_NTN", "other GEMMs"),
    ("_sinkhorn_fwd_kernel", "mHC Sinkhorn"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda", "elementwise and other"),
])
def test_kernel_names_land_in_their_region(kernel, region):
    assert _module().region_of(kernel) == region


@pytest.mark.parametrize("entry", ["bogus", "sparse", "sparse:0", "dense:2:cudnn", "warm:2", "sparse:2:fp4",
                                   "sparse:2:fp8:bf16", "sparse:2:triton:reference", "sparse:2:fp8:triton:x",
                                   "sparse:2:fp8:fp8"])
def test_bad_rows_entry_is_refused_with_the_rule(entry):
    with pytest.raises(SystemExit, match=r"--rows entry .*phase:L\[:backend\]\[:precision\]"):
        _module().parse_rows([entry])


def test_rows_entries_name_backend_and_precision_in_either_order():
    assert _module().parse_rows(["sparse:4", "warmup:2:reference", "sparse:4:fp8", "dense:2:fp8:reference"]) == [
        ("sparse", 4, "triton", "bf16"), ("warmup", 2, "reference", "bf16"), ("sparse", 4, "triton", "fp8"),
        ("dense", 2, "reference", "fp8")]


@pytest.mark.parametrize("args, says", [
    (["--iters", "0"], "--iters 0: must be at least 1"),
    (["--stage", "99"], "--stage 99: the recipe has no such curriculum stage"),
    (["--recipe", "nope.yaml"], "--recipe nope.yaml: recipe not found"),
    (["--device", "nosuch"], "--device nosuch:"),
    (["--profile", "sparse"], "--profile entry 'sparse'"),
])
def test_bad_arguments_exit_1_with_one_line_and_no_traceback(tmp_path, args, says):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", *args], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
