"""The per-rank memory plan (validators/memory_plan.py) and rule V4-MEMORY.

Checked against independent references: the pipeline schedules' in-flight counts against torch's own
warm-up formulas, the parameter term against the parameter list (itself checked against the built model in
test_param_count.py), the plan's peak against GPU memory measured on an H200 (memory_h200.json), and the
over-budget variants of the issue (Flash on one node at pp 1, a 1M-token stage at cp 1) against the fixes
the rule proposes, applied and validated again.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import shlex
import time
from pathlib import Path

import pytest
import yaml

from test_validate_fixes import proposed_edits
from validate_helpers import FLASH_4N_FP32, FLASH_4N_SEED_004, RECIPES, invoke, validate_file
from v4launch.recipe_loading import load_recipe
from v4launch.validators.memory_fixes import with_edits
from v4launch.validators.memory_activations import layer_bytes_per_token
from v4launch.validators.memory_plan import GIB, in_flight_ops, memory_plan, rank_plans
from v4launch.validators.param_count import model_buffers, model_params
from v4launch.validators.schema import Recipe

HERE = Path(__file__).resolve().parent


def test_in_flight_micro_batches_follow_torch_schedules():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rng = random.Random()
    for _ in range(200):
        pp, vpp = rng.choice([2, 4, 8]), rng.choice([1, 2, 4])
        rounds = rng.randint(1, 4)
        accum = pp * rounds if vpp > 1 else rng.randint(pp, 4 * pp)
        for rank in range(pp):
            ops = in_flight_ops(pp, vpp, rank, accum)
            if vpp == 1:  # Schedule1F1B: warmup_chunks = min(n_microbatches, num_stages - stage_index)
                assert len(ops) == min(accum, pp - rank)
            else:
                per_round = accum // max(1, accum // pp)
                warmup = schedules._get_warmup_ops(rank, vpp, per_round, pp, accum)
                assert len(ops) == min(warmup + 1, accum * vpp), (pp, vpp, rank, accum)
                assert ops[:per_round] == [0] * min(per_round, len(ops)) and max(ops) < vpp


def test_parameter_terms_of_flash_4n():
    """PP1: the one pipeline rank holds every layer. The routed experts / ep 32 (8.86 B per GPU) are stored in bf16:
    2 B weight, 2 B gradient, 2 B remainder of the exact fp32 master, 2 B bf16 Muon momentum. The 7.47 B dense
    parameters (sparse phase, indexers included) stay fp32 FSDP shards / 32 (dp·cp): 4 B weight and gradient, bf16
    moments (Muon 2 B, AdamW 2 + 2 B). Buffers (hash tables, router biases, counts) whole."""
    recipe = load_recipe(RECIPES / "flash_4n.yaml").recipe
    (plan,) = rank_plans(recipe, 2)  # sparse_64k: 64 sequences over dp 8 = 8 micro-batches per step
    specs = model_params(recipe.model, "sparse")
    dense = sum(s.numel for s in specs if not s.routed)
    routed = sum(s.numel for s in specs if s.routed)
    assert routed % 32 == 0 and round(routed / 32 / 1e9, 2) == 8.86 and round(dense / 1e9, 2) == 7.47
    assert all(s.optimizer == "muon" for s in specs if s.routed)
    buffers = sum(b.numel * b.itemsize for b in model_buffers(recipe.model))
    weights = -(-(4 * dense + 2 * routed) // 32)  # bytes over the rank's elements, rounded up once
    assert plan.term("parameters").bytes == weights + buffers and plan.term("parameters").dtype == "bf16/fp32"
    assert plan.term("gradients").bytes == weights  # kept across the step's micro-batches
    muon = sum(s.numel for s in specs if not s.routed and s.optimizer == "muon")
    remainders, momentum, adamw = 2 * routed, 2 * (routed + muon), (2 + 2) * (dense - muon)
    assert plan.term("optimizer").bytes == -(-(remainders + momentum + adamw) // 32)
    assert plan.total_bytes == sum(t.bytes for t in plan.terms)
    assert plan.allocated_bytes == plan.total_bytes - plan.term("headroom").bytes
    assert [t.bytes for t in plan.largest(3)] == sorted((t.bytes for t in plan.terms), reverse=True)[:3]


def test_parameter_terms_of_flash_4n_in_seed_004_shape_rank_0():
    """Seed 004's shape with fp32 storage: rank 0 holds E and layers 0-9 (Et*10): dense / 8 (FSDP over dp·cp = 8),
    experts / ep 8, fp32; Muon 4 B, AdamW 8 B per element; buffers (hash tables, router biases, counts) whole."""
    recipe = load_recipe(RECIPES / "flash_4n.yaml", list(FLASH_4N_SEED_004)).recipe
    plan = rank_plans(recipe, 0)[0]
    specs = [s for s in model_params(recipe.model, "dense") if s.holder == "E" or (s.layer is not None and s.layer < 10)]
    dense = sum(s.numel for s in specs if not s.routed)
    routed = sum(s.numel for s in specs if s.routed) // 8
    buffers = sum(b.numel * b.itemsize for b in model_buffers(recipe.model) if b.layer < 10)
    # the dense shards' bytes are rounded up once, over the rank's elements (dense / 8 is not whole here)
    assert plan.term("parameters").bytes == -(-4 * dense // 8) + 4 * routed + buffers
    muon = sum(s.numel for s in specs if not s.routed and s.optimizer == "muon")
    assert plan.term("optimizer").bytes == -(-(4 * muon + 8 * (dense - muon)) // 8) + 4 * routed
    assert plan.total_bytes == sum(t.bytes for t in plan.terms)
    assert plan.allocated_bytes == plan.total_bytes - plan.term("headroom").bytes
    assert [t.bytes for t in plan.largest(3)] == sorted((t.bytes for t in plan.terms), reverse=True)[:3]


def test_worst_rank_is_planned_and_activations_scale_with_rows():
    recipe = load_recipe(RECIPES / "flash_4n.yaml", [*FLASH_4N_SEED_004, "parallel.recompute_granularity=selective",
                                                      "parallel.recompute_modules=[mla_up_proj]"]).recipe
    plans = rank_plans(recipe, 2)
    assert memory_plan(recipe, 2).total_bytes == max(p.total_bytes for p in plans)
    assert [p.in_flight for p in plans] == [4, 3, 2, 1]  # 1F1B: pp - rank
    half = with_edits(recipe, {"curriculum.stages.2.cp": 2})
    a, b = memory_plan(recipe, 2).term("activations").bytes, memory_plan(half, 2).term("activations").bytes
    assert abs(a / b - 2) < 0.01


CALIBRATION = json.loads((HERE / "memory_h200.json").read_text())
TOLERANCE = 0.075
"""Worst measured row (benchmarks/results/memory_calibration_h200_2026-12-01.txt): -5.8% (L2, 32K, no recompute)
and +5.7% (L2, 64K, whole-layer recompute); the issue's bound is 15%."""


def _measured_recipe(row: dict) -> Recipe:
    model = {**CALIBRATION["model"], "n_layers": row["L"], "compress_ratios": [4, 128] * (row["L"] // 2),
             "max_position_embeddings": max(row["T"], 65536)}
    return Recipe.model_validate({
        "name": "measured", "model": model, "attention": {"kernel_backend": row["path"], "kl_chunk_size": 1024},
        "parallel": {"recompute_granularity": row.get("recompute", "none")},
        "cluster": {"gpu": "H200", "nodes": 1, "gpus_per_node": 1},
        "curriculum": {"stages": [{"name": "s", "seq_len": row["T"], "phase": row["phase"], "steps": 1}]}})


@pytest.mark.parametrize("row", CALIBRATION["rows"],
                         ids=lambda r: f"{r['phase']}-{r['path']}-{r.get('recompute', 'none')}-L{r['L']}-T{r['T']}")
def test_plan_is_within_tolerance_of_the_peak_measured_on_an_h200(row):
    """One H200, Flash widths (dim 4096, 64 heads x 512, 6 of 16 experts + shared, vocab 129280), L layers
    alternating CSA / HCA, one packed sequence of T tokens, bf16 autocast over fp32 parameters, forward +
    backward without an optimizer (its state is left out of the plan's figure here), with and without
    whole-layer recompute (benchmarks/memory_calibration.py)."""
    plan = memory_plan(_measured_recipe(row), 0)
    planned = plan.allocated_bytes - plan.term("optimizer").bytes
    measured = row["measured"] if "measured" in row else row["params"] + row["peak"]
    assert abs(planned / measured - 1) <= TOLERANCE, (planned / GIB, measured / GIB)


BENCH_AS_MEASURED = tuple(f"curriculum.stages.{i}.seq_len=8192" for i in range(3)) + (
    "parallel.micro_batch_size=1", "parallel.global_batch_size=1", "optimizer.name=muon_adamw", "compile.enable=false",
    "compile.cuda_graph=false")
"""bench_h200.yaml as it was when the two rows below were measured (one 8,192-token row per step, Muon, eager)."""

PRODUCT_RUNS = [  # (recipe, overrides, peak GiB of the job's `memory` event on one H200, where it is recorded)
    ("bench_h200.yaml", BENCH_AS_MEASURED, 33.62, "benchmarks/results/compile_h200_2026-12-01_confirm_eager.txt"),
    ("bench_h200.yaml", BENCH_AS_MEASURED + ("parallel.recompute_granularity=full",), 16.53,
     "benchmarks/results/recompute_full_h200.md"),
    ("tiny_cpu.yaml", ("cluster.gpu=H200", "cluster.gpus_per_node=1", "curriculum.stages.2.cp=1"), 0.21,
     "benchmarks/results/tiny_run_h200_2026-12-01_after_mhc.log"),
]
PRODUCT_TOLERANCE = 0.15
"""Issue 18's bound. Whole runs (optimizer, data loader, every phase) plan +11.1% for the recompute row (the
warm-up stage's reference attention under whole-layer recompute, docs/memory-plan.md); the job logs the
peak with two decimals, which for the tiny row alone is +-2.4%."""


@pytest.mark.parametrize("recipe,overrides,measured_gib,source", PRODUCT_RUNS,
                         ids=[f"{r}{'+' + ','.join(o[len(BENCH_AS_MEASURED):] if r == 'bench_h200.yaml' else o) if o else ''}"
                              for r, o, _, _ in PRODUCT_RUNS])
def test_plan_is_within_the_issue_bound_of_whole_product_runs_on_an_h200(recipe, overrides, measured_gib, source):
    """`v4launch run` on one H200: the job's peak (torch.cuda.max_memory_allocated over the whole run) against
    the plan's allocated bytes maximised over the stages (the headroom is what max_memory_allocated does not see)."""
    loaded = load_recipe(RECIPES / recipe, list(overrides)).recipe
    planned = max(memory_plan(loaded, i).allocated_bytes for i in range(len(loaded.curriculum.stages))) / GIB
    assert abs(planned / measured_gib - 1) <= PRODUCT_TOLERANCE, (planned, measured_gib, source)


@pytest.mark.parametrize("row", CALIBRATION["oom_rows"], ids=lambda r: f"{r['recompute']}-L{r['L']}-T{r['T']}")
def test_rows_that_ran_out_of_memory_are_planned_over_the_h200(row):
    plan = memory_plan(_measured_recipe(row), 0)
    assert plan.allocated_bytes - plan.term("optimizer").bytes > 139.8 * GIB and not plan.fits


def test_whole_layer_recompute_keeps_the_layer_inputs_and_re_runs_one_layer():
    """granularity full: each layer keeps its input streams (a·hc·d per token), the compressed KV, top-k and
    bf16 weight copies of the layers are not kept, and one layer's whole figure moves to the transients."""
    row = {"phase": "sparse", "path": "triton", "L": 4, "T": 16384}
    plain = memory_plan(_measured_recipe(row), 0)
    full = memory_plan(_measured_recipe({**row, "recompute": "full"}), 0)
    m = _measured_recipe(row).model
    inputs = 2 * m.mhc.hc_mult * m.dim * row["T"] * row["L"]
    head_and_embed = plain.term("activations").bytes - sum(
        sum(v for k, v in layer_bytes_per_token(m, r, "sparse", kernels=True, act=2, topk=m.indexer.topk).items()
            if k != "top-k") * row["T"] for r in m.compress_ratios)
    assert full.term("activations").bytes == pytest.approx(inputs + head_and_embed, rel=1e-9)
    assert full.term("topk").bytes == full.term("compressed_kv").bytes == 0 < plain.term("topk").bytes
    head = 2 * m.vocab_size * m.dim  # the head's bf16 copy stays (it runs outside the layers)
    assert head <= full.term("weight_copies").bytes < head * 1.01 < plain.term("weight_copies").bytes
    assert plain.term("transients").bytes < full.term("transients").bytes < plain.allocated_bytes
    assert full.allocated_bytes < plain.allocated_bytes


@pytest.mark.parametrize("nodes,folding_ep,expected", [
    (4, 32, ["precision.params_dtype=bf16", "parallel.cpu_offloading=true"]), (6, 16, ["cluster.nodes=8"])])
def test_ep_fold_fix_does_not_send_the_user_to_a_layout_the_memory_plan_refuses(nodes, folding_ep, expected):
    """flash_8n on 4 nodes: ep=64 no longer folds over dp·cp = 32. ep=32 would fold but not fit, and V4-MEMORY
    then proposed 8 nodes and ep=64 (the first fix undone). The EP-FOLD fix is now the memory rule's whole
    fix, and applied it validates clean: on 4 nodes precision-aware storage with host offload (flash_4n's shape);
    on 6 nodes no doubling splits the 64-way CP stage and the search goes on to the powers of two (8). On a CPU
    target (no memory budget) the plain ep fix stays."""
    report = validate_file(RECIPES / "flash_8n.yaml", [f"cluster.nodes={nodes}"])
    fold = [v for v in report.violations if v.rule_id == "V4-EP-FOLD"]
    assert fold and all(f"an ep of {folding_ep} alone would fold" in v.fix for v in fold), [v.fix for v in fold]
    edits = proposed_edits(fold[0].fix)
    assert set(expected) <= set(edits), edits
    assert nodes == 6 or not [e for e in edits if e.startswith("cluster.nodes=")], edits
    assert validate_file(RECIPES / "flash_8n.yaml", [f"cluster.nodes={nodes}", *edits]).ok
    debug = validate_file(RECIPES / "flash_debug.yaml", ["parallel.ep=4"])
    (plain,) = {v.fix for v in debug.violations if v.rule_id == "V4-EP-FOLD"}
    assert plain.startswith("set parallel.ep=2 (the largest ep up to 4")


def test_flash_on_one_node_at_pp1_fails_and_the_proposed_shape_fits():
    """Seed 004's shape (fp32 storage) on one node at pp 1: the experts alone do not fit. The fewest nodes that
    hold the curriculum are 4 with precision-aware storage and host offload (8 with fp32 storage: flash_8n)."""
    over = [*FLASH_4N_SEED_004, "cluster.nodes=1", "parallel.pp=1", "parallel.pp_layout=null"]
    report = validate_file(RECIPES / "flash_4n.yaml", over)
    assert report.failed_rule_ids() == {"V4-MEMORY"}
    v = report.violations[0]
    assert v.field == "cluster.gpu_memory_gib" and v.value == 139.8
    assert re.search(r"needs [\d.]+ GiB per GPU > 139\.8 GiB", v.message)
    assert len(re.findall(r"\b[a-z][a-z +0-9-]* [\d.]+ GiB", v.message.split("largest:")[1])) == 3
    assert "parameters" in v.message and "optimizer states" in v.message  # the experts alone do not fit
    edits = proposed_edits(v.fix)
    assert "cluster.nodes=4" in edits and "nothing fits on the recipe's 1 node(s), 4 is the fewest" in v.fix
    assert {"precision.params_dtype=bf16", "parallel.cpu_offloading=true"} <= set(edits), edits
    fixed = validate_file(RECIPES / "flash_4n.yaml", [*over, *edits])
    assert fixed.ok and all(s.derived["memory"]["fits"] for s in fixed.stages)


def test_flash_4n_fits_and_seed_004_shape_is_sent_to_precision_aware_storage_on_its_4_nodes(in_tmp: Path):
    """flash_4n.yaml validates clean: every stage fits its H200, and the nodes' host memory holds the offloaded
    layer inputs (V4-HOST-MEMORY checked in every stage, not skipped). Seed 004's shape on the same 4 nodes is
    refused in every stage, and the one whole-recipe fix printed names precision-aware storage with host offload
    on these 4 nodes (before it, the fix was 8 nodes)."""
    report = validate_file(RECIPES / "flash_4n.yaml")
    assert report.ok and all(s.derived["memory"]["fits"] for s in report.stages)
    assert all(s.derived["memory"]["host_offload_bytes"] > 0 for s in report.stages)
    host = [r.status for s in report.stages for r in s.results if r.rule_id == "V4-HOST-MEMORY"]
    assert host == ["pass"] * len(report.stages)
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), *FLASH_4N_SEED_004])
    assert exc is None and code == 1
    (line,) = [x for x in out.splitlines() if x.startswith("  → V4-MEMORY: fix: run `")]
    command = shlex.split(line.split("`")[1])
    for edit in ("precision.params_dtype=bf16", "precision.exp_avg_dtype=bf16", "precision.exp_avg_sq_dtype=bf16",
                 "parallel.cpu_offloading=true", "parallel.pp=1", "parallel.ep=32"):
        assert edit in command, (edit, command)
    assert not [w for w in command if w.startswith("cluster.nodes=")] and "is the fewest" not in line, line


OVER_BUDGET_VARIANTS = [
    ("flash_4n.yaml", list(FLASH_4N_SEED_004)),
    ("flash_8n.yaml", ["parallel.recompute_granularity=none"]),
    ("flash_8n.yaml", ["parallel.ep=16"]),
    ("flash_8n.yaml", ["cluster.gpu_memory_gib=80"]),
    ("pro_64n.yaml", ["cluster.gpu_memory_gib=100"]),
    ("pro.yaml", ["parallel.distributed_optimizer=false"]),
    ("bench_h200.yaml", ["cluster.gpu_memory_gib=20"]),
    ("pro_64n.yaml", ["cluster.gpu_memory_gib=60"]),
    ("flash_4n.yaml", [*FLASH_4N_SEED_004, "parallel.pp=2", "parallel.pp_layout=Et*22|t*21mL"]),
    ("flash_4n.yaml", list(FLASH_4N_FP32)),
    ("flash_4n.yaml", ["cluster.gpu=B200"]),
    ("flash_8n.yaml", ["curriculum.stages.5.seq_len=2097152", "model.max_position_embeddings=2097152"]),
]


def _variant_id(x) -> str:
    if isinstance(x, str):
        return x
    text = " ".join(x)
    return text.replace(" ".join(FLASH_4N_SEED_004), "seed-004-shape").replace(" ".join(FLASH_4N_FP32), "fp32-storage")


@pytest.mark.parametrize("name,over", OVER_BUDGET_VARIANTS, ids=_variant_id)
def test_every_proposed_memory_fix_validates_and_the_job_plans_it(name, over):
    """Apply the first alternative of each stage's V4-MEMORY fix on its own: the recipe must then validate with
    no error (every stage fits), and the job's planner accept it."""
    from v4launch.training.plan import plan_curriculum

    report = validate_file(RECIPES / name, over)
    assert report.failed_rule_ids() == {"V4-MEMORY"}, [(v.rule_id, v.message) for v in report.violations]
    for v in report.violations:  # every stage's fix is a whole one: applied alone, the recipe validates
        edits = proposed_edits(v.fix)
        assert edits, v.fix
        fixed = validate_file(RECIPES / name, [*over, *edits])
        assert fixed.ok, (v.stage, v.fix, [(x.rule_id, x.stage, x.message) for x in fixed.violations])
        recipe = load_recipe(RECIPES / name, [*over, *edits]).recipe
        plan_curriculum(recipe, recipe.cluster.world_size)


def test_micro_batch_size_is_proposed_when_it_is_what_fits():
    report = validate_file(RECIPES / "flash_8n.yaml", ["parallel.micro_batch_size=2"])
    memory = [v for v in report.violations if v.rule_id == "V4-MEMORY"]
    assert memory and all("parallel.micro_batch_size=1" in v.fix for v in memory), [v.fix for v in memory]


def test_the_fix_search_is_quick_for_an_absurd_world():
    start = time.perf_counter()
    report = validate_file(RECIPES / "flash_8n.yaml", ["cluster.nodes=1048576", "parallel.global_batch_size=8388608"])
    assert time.perf_counter() - start < 10.0
    assert "V4-MEMORY" not in report.failed_rule_ids()


def test_a_1m_stage_at_cp1_fails_and_the_proposed_cp_validates(base_file: Path):
    over = ["parallel.pp=1", "parallel.pp_layout=null", "model.max_position_embeddings=1048576",
            "curriculum.stages.3.seq_len=1048576", "curriculum.stages.3.cp=1"]
    report = validate_file(base_file, over)
    assert report.failed_rule_ids() == {"V4-MEMORY"}
    (v,) = report.violations
    assert v.stage == "sparse_8k" and "1048576 rows" in v.message and "activations" in v.message
    cp = re.match(r"set curriculum\.stages\.3\.cp=(\d+) \(([\d.]+) GiB\)", v.fix)
    assert cp, v.fix
    fixed = validate_file(base_file, [*over, f"curriculum.stages.3.cp={cp.group(1)}"])
    assert fixed.ok
    assert abs(fixed.stages[3].derived["memory"]["total_bytes"] / GIB - float(cp.group(2))) < 0.05


def test_validate_prints_the_plan_per_stage(in_tmp: Path):
    """(Its speed is benchmarks/validate_speed.py's to measure, not a timed test's.)"""
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), *FLASH_4N_SEED_004])
    assert exc is None and code == 1
    assert "memory plan" in out and "over" in out
    for label in ("parameters", "gradients", "optimizer states", "activations", "compressed KV", "top-k",
                  "logits + loss", "headroom", "total", "budget"):
        assert label in out, label
    code, out, _, _ = invoke(["validate", str(RECIPES / "bench_h200.yaml")])
    assert code == 0 and "memory plan" in out and " ok" in out and "host: offloaded inputs" not in out
    code, out, _, _ = invoke(["validate", str(RECIPES / "flash_4n.yaml")])
    assert code == 0 and " ok" in out and "host: offloaded inputs" in out
    assert not re.search(r"\d over\b", out)  # no stage's total is over its budget ("no overlap" is the time plan's)


def test_explain_memory(in_tmp: Path):
    code, out, _, _ = invoke(["explain", "memory"])
    assert code == 0 and "V4-MEMORY" in out and "docs/memory-plan.md" in out and "cluster.gpu_memory_gib" in out


def test_cpu_target_without_a_budget_is_not_planned_against_one(base_file: Path):
    report = validate_file(base_file, ["cluster.gpu=cpu", "attention.kernel_backend=reference"])
    statuses = {r.status for s in report.stages for r in s.results if r.rule_id == "V4-MEMORY"}
    assert statuses == {"n/a"}
    report = validate_file(base_file, ["cluster.gpu=cpu", "attention.kernel_backend=reference",
                                       "cluster.gpu_memory_gib=0.01"])
    assert "V4-MEMORY" in report.failed_rule_ids()


def test_attention_workspace_follows_the_query_block_backward_of_sparse_csa():
    """At 16 / 32 heads the kernels' sparse-phase CSA backward runs over the segment's whole span of entries with
    a uint8 selection mask [rows, span + 1] where the span is at most SPAN_ROWS_PER_COLUMN per top-k column; past
    that it keeps the window's float32 dQ [rows, H, D] beside the dS buffer until the single pass adds the columns'
    dQ. At 64 heads (two-pass), in the dense phase and for HCA / SWA layers there is neither term."""
    from v4launch.validators.memory_activations import (KERNEL_DS_CAP_BYTES, SPAN_ROWS_PER_COLUMN, StageSetting,
                                                        attention_workspace)

    for rows in sorted(random.sample([2048, 4096, 8192, 16384, 65536], 3)):
        for heads in (16, 32, 64):
            m = load_recipe(RECIPES / "bench_h200.yaml").recipe.model.model_copy(update={"n_heads": heads})
            topk = m.indexer.topk
            for phase, ratio in itertools.product(("dense", "sparse"), (0, 4, 128)):
                s = StageSetting(rows=rows, seq_len=rows, cp=1, shard=1, accum=1, act=2, kernels=True,
                                 topk=topk, phase=phase, recompute=frozenset(), chunk=1024)
                got = attention_workspace(m, ratio, s)
                n = {0: 0, 128: rows // 128, 4: rows // 4 if phase == "dense" else topk}[ratio]
                extra = 0
                if ratio == 4 and phase == "sparse" and heads in (16, 32):
                    if rows // 4 <= SPAN_ROWS_PER_COLUMN * topk:
                        n, extra = rows // 4, rows * (rows // 4 + 1)
                    else:
                        extra = 4 * rows * heads * m.head_dim
                ds = min(KERNEL_DS_CAP_BYTES, rows * heads * (m.window_size + n) * 4)
                assert got == ds + extra, (rows, heads, phase, ratio)


def test_the_memory_plan_copies_the_kernel_dispatch_constants():
    """The memory plan (no torch) copies the attention backward's dispatch: which head counts run in query blocks
    and up to how many span rows per top-k column sparse CSA's columns join them. They must agree."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from v4launch.model.kernels import triton_attention, triton_attention_query_blocks
    from v4launch.validators import memory_activations

    assert memory_activations.SPAN_ROWS_PER_COLUMN == triton_attention.SPAN_PER_COLUMN
    assert triton_attention.QUERY_BLOCK_BACKWARD
    for heads in range(1, 129):
        q = torch.empty(1, heads, 512, dtype=torch.bfloat16)
        assert triton_attention_query_blocks.supported(q) == (heads in memory_activations.QUERY_BLOCK_HEADS), heads


STORAGE_CALIBRATION = json.loads((HERE / "memory_storage_h200.json").read_text())
STORAGE_TOLERANCE = 0.10
"""Rows with precision-aware storage and host offload (benchmarks/results/memory_calibration_storage_h200_*): the
issue's bound, ±10%. Worst measured: +9.1% (L4, 64K, whole-layer recompute, bf16 storage: the plan keeps the
gradients of a one-micro-batch step beyond the activations backward frees, which bf16 gradients overstate)."""


@pytest.mark.parametrize("row", STORAGE_CALIBRATION["rows"],
                         ids=lambda r: f"{r['recompute']}-L{r['L']}-T{r['T']}-{r['option'] or 'fp32'}")
def test_plan_with_storage_and_offload_is_within_ten_percent_of_an_h200(row):
    """As the test above, with ``precision.params_dtype: bf16`` (every matrix bf16 on one GPU without FSDP) and/or
    ``parallel.cpu_offloading`` (the layer inputs in host memory): the plan's GPU figure against the measured peak."""
    from v4launch.validators.memory_fixes import with_edits

    options = {"bf16": {"precision.params_dtype": "bf16"}, "offload": {"parallel.cpu_offloading": True}}
    edits = {k: v for part in row["option"].split("+") if part for k, v in options[part].items()}
    assert STORAGE_CALIBRATION["model"] == CALIBRATION["model"]
    recipe = with_edits(_measured_recipe(row), edits)
    plan = memory_plan(recipe, 0)
    planned = plan.allocated_bytes - plan.term("optimizer").bytes
    measured = row["params"] + row["peak"]
    assert abs(planned / measured - 1) <= STORAGE_TOLERANCE, (planned / GIB, measured / GIB)
    if "offload" in row["option"]:
        assert plan.host_offload_bytes > 0


def test_nothing_fits_here_names_the_stage_that_forces_more_nodes(in_tmp: Path):
    """pro_16n: even with every lever on its 16 nodes one stage stays over budget; the fix names it and its GiB, and
    that figure is the plan of that stage under those levers (pp 1, the largest ep and cp, storage and offload)."""
    from v4launch.validators.memory_fixes import BF16_STORAGE, FULL_RECOMPUTE, OFFLOAD
    from v4launch.validators.memory_fixes_whole import forcing_stage

    recipe = load_recipe(RECIPES / "pro_16n.yaml").recipe
    name, gib, pp, _ = forcing_stage(recipe)
    index = next(i for i, st in enumerate(recipe.curriculum.stages) if st.name == name)
    world = recipe.cluster.world_size // pp
    cp = max(c for c in range(1, world + 1) if world % c == 0 and recipe.curriculum.stages[index].seq_len % c == 0)
    edits = {"parallel.pp": pp, "parallel.ep": 128 if world % 128 == 0 else world, "parallel.distributed_optimizer": True,
             **FULL_RECOMPUTE, **BF16_STORAGE, **OFFLOAD, "parallel.micro_batch_size": 1,
             f"curriculum.stages.{index}.cp": cp}
    if pp == 1:
        edits.update({"parallel.vpp": 1, "parallel.pp_layout": None})
    plan = memory_plan(with_edits(recipe, edits), index)
    assert gib > 139.8 and abs(plan.total_bytes / GIB - gib) < 0.05, (name, gib, plan.total_bytes / GIB)
    code, text, _, exc = invoke(["validate", str(RECIPES / "pro_16n.yaml")])
    assert code == 1 and exc is None
    text = " ".join(text.split())  # one line however the console wrapped it
    assert f"nothing fits on the recipe's 16 node(s), 32 is the fewest: stage {name} needs {gib:.1f} GiB per GPU" in text


@pytest.mark.parametrize("row", STORAGE_CALIBRATION["host_rows"], ids=lambda r: f"host-L{r['L']}-T{r['T']}")
def test_planned_host_memory_is_what_the_offload_held_on_an_h200(row):
    """The plan's pinned host bytes per GPU (``MemoryPlan.host_offload_bytes``) against the peak the offload held
    (``OffloadStats.peak_host_bytes``, benchmarks/offload_step.py on one H200): every layer input, the first
    layer's fp32, exactly."""
    from v4launch.validators.memory_fixes import with_edits

    recipe = with_edits(_measured_recipe(row), {"parallel.cpu_offloading": True})
    assert memory_plan(recipe, 0).host_offload_bytes == row["host_peak"]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_fused_warmup_kl_keeps_its_gradient_from_forward_to_backward(recompute):
    """The warm-up KL on the kernels forms the indexer's gradient in the forward (model/kernels/layer._DenseKL) and
    keeps it to the layer's backward with or without whole-layer recompute: per CSA layer dq [T, HI, dI] bf16,
    dw [T, HI] and the key gradient [seq_len / 4, dI] float32, on top of what the same layers keep in the sparse
    phase (at Flash width 256 MiB per CSA layer at 16K rows). The reference path runs its KL in chunks instead."""
    row = {"path": "triton", "L": 4, "T": 16384, "recompute": recompute}
    warm, sparse = (memory_plan(_measured_recipe({**row, "phase": p}), 0) for p in ("warmup", "sparse"))
    m = _measured_recipe({**row, "phase": "warmup"}).model
    ix = m.indexer
    per_layer = row["T"] * (2 * ix.n_heads * ix.head_dim + 4 * ix.n_heads) + 4 * ix.head_dim * row["T"] // 4
    csa = sum(r == 4 for r in m.compress_ratios)
    kept = warm.term("activations").bytes - sparse.term("activations").bytes
    assert csa == 2 and kept == pytest.approx(csa * per_layer, rel=1e-9)  # the sparse KL's tables: the top-k term
    reference = memory_plan(_measured_recipe({**row, "phase": "warmup", "path": "reference"}), 0)
    assert reference.term("activations").bytes < warm.term("activations").bytes
