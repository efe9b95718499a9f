"""The time plan (validators/time_plan.py) and rule V4-SLURM-SEGMENTS.

The step time is held to this product's own H200 measurements, read from the committed result files (never
copied here): the bench shape's compiled, graph-replayed sparse step (the figure the ``graph`` calibration was
fitted on) and its dense step (not fitted on: an independent check), and four Flash-width layers at 64K under
whole-layer recompute in each phase (the ``eager_*`` calibrations, benchmarks/flash_width.py's rows). The communication terms and the totals are checked against
independent arithmetic written out here.
"""

from __future__ import annotations

import json
import re
import sys
from math import ceil

import pytest

from validate_helpers import REPO, RECIPES, invoke, validate_file
from v4launch.recipe_loading import load_recipe
from v4launch.validators.memory_fixes import with_edits
from v4launch.validators.schema.cluster import GPU_PEAK_BF16_TFLOPS
from v4launch.validators.time_plan import (CALIBRATIONS, calibration_for, ep_passes, segment_seconds, stage_time,
                                           time_plan)

RESULTS = REPO / "benchmarks" / "results"
TOLERANCE = 0.20
"""The plan's step time within 20% of the measured one (issue 41)."""


def _row(source: str) -> dict:
    """The measured row a calibration's ``source`` names (``file.json rows[i].ms``)."""
    name, where = source.split(" ", 1)
    match = re.fullmatch(r"rows\[(\d+)\]\.ms", where)
    assert match, source
    return json.loads((REPO / name).read_text())["rows"][int(match.group(1))]


def _measured(source: str) -> float:
    """Seconds of the measured step a calibration's ``source`` names."""
    return _row(source)["ms"] / 1e3


def _bench(stage: str):
    recipe = load_recipe(RECIPES / "bench_h200.yaml", []).recipe
    index = [s.name for s in recipe.curriculum.stages].index(stage)
    return recipe, stage_time(recipe, index)


def _flash_layers():
    """The recipe the offload benchmark builds (benchmarks/memory_calibration.recipe_for: 4 Flash-width layers,
    whole-layer recompute, 65,536 tokens, sparse, triton kernels, one H200)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from memory_calibration import recipe_for
    finally:
        sys.path.pop(0)
    return recipe_for("full", 4, 65536)


def test_bench_sparse_step_within_20_percent_of_the_h200_measurement():
    recipe, est = _bench("sparse_4k")
    assert calibration_for(recipe) is CALIBRATIONS["graph"]
    measured = _measured(CALIBRATIONS["graph"].source)
    assert est.tokens_per_step == 8192
    assert abs(est.step_s / measured - 1) <= TOLERANCE, (est.step_s, measured)


def test_bench_dense_step_within_20_percent_of_its_measurement_not_fitted_on():
    _, est = _bench("dense_4k")
    data = json.loads((RESULTS / "train_step_h200_2026-12-03_19e7493_dense_warmup.json").read_text())
    (dense,) = [r for r in data["rows"] if r["phase"] == "dense"]
    assert data["env"]["args"]["tokens"] == est.tokens_per_step
    assert abs(est.step_s / (dense["ms"] / 1e3) - 1) <= TOLERANCE, (est.step_s, dense["ms"])


@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
def test_flash_width_layers_within_20_percent_of_the_h200_measurement(phase):
    """benchmarks/flash_width.py's 4-layer row of each phase: the recipe it measured (flash_4n's widths, one EP32
    rank's experts, 64K tokens) is priced at that phase's calibration, the FLOPs the file records are this
    module's count, and the plan's step is the measured one within 20%."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from flash_width import bench_recipe
    finally:
        sys.path.pop(0)
    calibration = CALIBRATIONS[f"eager_{phase}"]
    row = _row(calibration.source)
    assert (row["phase"], row["layers"], row["backend"], row["tokens"]) == (phase, 4, "triton", 65536)
    recipe, shape = bench_recipe(str(RECIPES / "flash_4n.yaml"), 0, phase, 4, None, "triton", False)
    assert shape["local_experts"] == 8 and shape["top_k"] == 6  # 256 routed experts over EP32, top-6
    stage = recipe.curriculum.stages[0]
    assert calibration_for(recipe, stage) is calibration
    est = stage_time(recipe, 0)
    assert est.ep_s == est.cp_s == est.dp_s == 0  # one GPU: nothing to exchange
    assert est.flops_per_step == pytest.approx(row["flops"], rel=1e-9)
    assert abs(est.step_s / (row["ms"] / 1e3) - 1) <= TOLERANCE


def test_each_flash_4n_stage_priced_at_its_phase():
    """flash_4n (eager): dense, warm-up and sparse stages at their own measured rates; the JSON lists each once."""
    recipe = load_recipe(RECIPES / "flash_4n.yaml", []).recipe
    plan = time_plan(recipe)
    assert [s.calibration for s in plan.stages] == [f"eager_{s.phase}" for s in recipe.curriculum.stages]
    used = [c["key"] for c in plan.to_dict()["assumptions"]["calibrations"]]
    assert used == ["eager_dense", "eager_warmup", "eager_sparse"]


def test_recompute_adds_one_forward_of_the_layers():
    """Whole-layer recompute costs 4/3 of the layers' FLOPs (forward, recompute, backward = 2 forwards), not of
    the head; 'none' is exactly 3 forwards."""
    from v4launch.validators.cost_model import unit_costs

    recipe = _flash_layers()
    stage = recipe.curriculum.stages[0]
    units = unit_costs(recipe.model, stage.seq_len, stage.phase, True)
    fwd, layers = sum(sum(v) for v in units.values()), sum(units["t"])
    full = stage_time(recipe, 0).flops_per_step
    none = stage_time(with_edits(recipe, {"parallel.recompute_granularity": "none"}), 0).flops_per_step
    assert none == pytest.approx(3 * fwd * 65536)
    assert full - none == pytest.approx(layers * 65536)


def test_b200_scales_the_compute_by_the_peak_ratio():
    recipe, est = _bench("sparse_4k")
    b200 = stage_time(with_edits(recipe, {"cluster.gpu": "B200"}), 2)
    ratio = GPU_PEAK_BF16_TFLOPS["B200"] / GPU_PEAK_BF16_TFLOPS["H200"]
    assert b200.compute_s == pytest.approx(est.compute_s / ratio)


def test_ep_all_to_all_bytes_over_the_named_links():
    """flash_4n's EP32 over 4 nodes of 8: each GPU sends K rows of dim bf16 per token and MoE layer, out and back,
    in forward, recompute and backward; 7 of its 31 peers share its node, 24 do not."""
    recipe = load_recipe(RECIPES / "flash_4n.yaml", []).recipe
    m = recipe.model
    for intra, inter in ((450.0, 50.0), (900.0, 25.0)):
        r = with_edits(recipe, {"cluster.intra_node_gb_per_s": intra, "cluster.inter_node_gb_per_s": inter})
        est = stage_time(r, 2)
        dp_cp = 32
        rows = est.tokens_per_step / dp_cp * (m.n_layers + m.mtp.depth) * m.moe.n_activated_experts
        sent = rows * m.dim * 2 * 2 * 3 * 31 / 32
        assert est.ep_s == pytest.approx(max(sent * 7 / 31 / (intra * 1e9), sent * 24 / 31 / (inter * 1e9)))


@pytest.mark.parametrize("granularity, modules, passes", [
    ("full", [], 3), ("selective", ["moe"], 3), ("selective", ["mlp"], 3), ("selective", ["layernorm"], 2),
    ("selective", ["moe_act", "shared_experts"], 2), ("none", [], 2)])
def test_ep_bytes_count_the_recompute_only_where_it_replays_the_moe(granularity, modules, passes):
    """The all-to-all crosses again in backward's recompute when the replayed region holds the MoE's dispatch
    (model/parallel/recompute.py's table): the whole layer, or ``moe`` / ``mlp``; not the activation alone."""
    base = load_recipe(RECIPES / "flash_4n.yaml", []).recipe
    recipe = with_edits(base, {"parallel.recompute_granularity": granularity, "parallel.recompute_modules": modules})
    assert ep_passes(recipe) == passes
    no_recompute = stage_time(with_edits(base, {"parallel.recompute_granularity": "none",
                                                "parallel.recompute_modules": []}), 2)
    assert stage_time(recipe, 2).ep_s == pytest.approx(no_recompute.ep_s * passes / 2, rel=1e-12)


def test_cp_exchange_is_zero_at_cp1_and_grows_with_the_sequence():
    recipe = load_recipe(RECIPES / "flash_4n.yaml", []).recipe
    cp1 = stage_time(with_edits(recipe, {"parallel.cp": 1}), 0)
    assert cp1.cp_s == 0
    assert 0 < stage_time(recipe, 2).cp_s < stage_time(recipe, 5).cp_s


def test_pipeline_bubble_is_the_1f1b_fraction():
    recipe = load_recipe(RECIPES / "pro_64n.yaml", []).recipe
    p = recipe.parallel
    for i, stage in enumerate(recipe.curriculum.stages):
        dp = recipe.stage_dp(stage)
        accum = recipe.stage_global_batch(stage) // (dp * p.micro_batch_size)
        assert stage_time(recipe, i).bubble == pytest.approx((p.pp - 1) / (p.vpp * accum))


@pytest.mark.parametrize("eval_every", [0, 100])
def test_totals_steps_wall_gpu_hours_and_segments(eval_every: int):
    """Wall time is steps x step time plus the held-out evaluations: one at each stage end and one after every
    logging.eval_interval_steps-th step, each ceil(8 / dp) forwards against accum x 4 (whole-layer recompute)."""
    recipe = load_recipe(RECIPES / "flash_4n.yaml", [f"logging.eval_interval_steps={eval_every}"]).recipe
    plan = time_plan(recipe)
    world = recipe.cluster.nodes * recipe.cluster.gpus_per_node
    usable = recipe.slurm.time_min * 60 - recipe.slurm.signal_delay_s
    for stage, est in zip(recipe.curriculum.stages, plan.stages):
        tokens = recipe.stage_global_batch(stage) * stage.seq_len
        assert est.steps == ceil(stage.tokens / tokens)
        assert est.step_s == pytest.approx(est.compute_s + est.ep_s + est.cp_s + est.dp_s)
        dp = recipe.stage_dp(stage)
        accum = recipe.stage_global_batch(stage) // dp  # micro_batch_size 1
        evals = 1 + ((est.steps - 1) // eval_every if eval_every else 0)
        assert est.evaluations == evals and (evals > 1) == (eval_every > 0)
        assert est.eval_s == pytest.approx(evals * ceil(8 / dp) / (accum * 4) * est.step_s)
        assert est.wall_s == pytest.approx(est.steps * est.step_s + est.eval_s)
        assert est.gpu_hours == pytest.approx(est.wall_s / 3600 * world)
        assert est.segments == ceil(est.wall_s / usable)
    assert segment_seconds(recipe) == usable
    d = plan.to_dict()
    assert d["total"]["gpu_hours"] == pytest.approx(sum(s.gpu_hours for s in plan.stages))
    assert d["total"]["wall_s"] == pytest.approx(sum(s.wall_s for s in plan.stages))


def test_cpu_recipe_has_no_estimate():
    recipe = load_recipe(RECIPES / "tiny_cpu.yaml", []).recipe
    assert time_plan(recipe) is None and stage_time(recipe, 0) is None


def test_bandwidth_fields_refuse_nonsense(tmp_path):
    from v4launch.errors import RecipeError

    with pytest.raises(RecipeError, match="intra_node_gb_per_s"):
        load_recipe(RECIPES / "flash_4n.yaml", ["cluster.intra_node_gb_per_s=0"])


# ------------------------------------------------------------------ V4-SLURM-SEGMENTS
def test_segments_rule_passes_without_a_cap_and_names_the_count():
    report = validate_file(RECIPES / "flash_4n.yaml")
    assert "V4-SLURM-SEGMENTS" not in {w.rule_id for w in report.warnings}
    rows = [r for s in report.stages for r in s.results if r.rule_id == "V4-SLURM-SEGMENTS"]
    assert rows and all(r.status == "pass" and "segment(s) of 240 min" in r.note for r in rows)


def test_segments_rule_warns_when_a_stage_needs_more_than_the_cap_and_its_fix_passes():
    plan = time_plan(load_recipe(RECIPES / "flash_4n.yaml", []).recipe)
    need = max(s.segments for s in plan.stages)
    report = validate_file(RECIPES / "flash_4n.yaml", [f"slurm.max_segments={need - 1}"])
    warned = [w for w in report.warnings if w.rule_id == "V4-SLURM-SEGMENTS"]
    assert len(warned) == 1 and warned[0].field == "slurm.max_segments" and warned[0].value == need - 1
    assert f"set slurm.max_segments={need}" in warned[0].fix
    fixed = validate_file(RECIPES / "flash_4n.yaml", [f"slurm.max_segments={need}"])
    assert "V4-SLURM-SEGMENTS" not in {w.rule_id for w in fixed.warnings}
    assert fixed.ok == report.ok  # a warning: the verdict does not change


def test_segments_rule_time_fix_fits_the_cap():
    recipe = load_recipe(RECIPES / "flash_4n.yaml", ["slurm.max_segments=100"]).recipe
    report = validate_file(RECIPES / "flash_4n.yaml", ["slurm.max_segments=100"])
    fix = next(w.fix for w in report.warnings if w.rule_id == "V4-SLURM-SEGMENTS")
    minutes = int(fix.split("slurm.time_min=")[1].split()[0])
    longer = validate_file(RECIPES / "flash_4n.yaml", ["slurm.max_segments=100", f"slurm.time_min={minutes}"])
    assert "V4-SLURM-SEGMENTS" not in {w.rule_id for w in longer.warnings}, recipe.slurm


def test_validate_prints_the_time_plan_and_json_holds_it(in_tmp):
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml")])
    assert exc is None and code == 0
    assert "time plan" in out and "GPU-h" in out and "total" in out
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), "--json"])
    js = json.loads(out)
    plan = js["time_plan"]
    assert len(plan["stages"]) == 6 and plan["total"]["gpu_hours"] > 0
    assert plan["assumptions"]["gpu"] == "H200" and plan["assumptions"]["inter_node_gb_per_s"] == 50.0
    assert js["stages"][0]["derived"]["time"]["steps"] == plan["stages"][0]["steps"]


def test_stages_off_triton_are_said_to_be_priced_at_the_triton_kernels(in_tmp):
    """Every calibration is the Triton kernels' (no other backend is measured): a stage on reference is priced as
    if it ran them, and the plan says which stages that is (JSON ``assumptions.priced_as_triton``, the CLI note)."""
    shipped = time_plan(load_recipe(RECIPES / "flash_4n.yaml").recipe)
    assert shipped.to_dict()["assumptions"]["priced_as_triton"] == []
    one = time_plan(load_recipe(RECIPES / "flash_4n.yaml", ["curriculum.stages.1.kernel_backend=reference"]).recipe)
    assert one.to_dict()["assumptions"]["priced_as_triton"] == ["warmup_64k"]
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), "curriculum.stages.1.kernel_backend=reference"])
    assert exc is None and "stage(s) warmup_64k run another kernel backend than triton" in " ".join(out.split())


def test_an_fp8_recipe_is_said_to_be_priced_as_bf16(in_tmp):
    """Every calibration is bf16: an FP8 recipe's compute gets the same figures, and the plan says so (JSON, CLI
    note); with precision.fp8_dispatch off, nothing else changes either."""
    bf16 = time_plan(load_recipe(RECIPES / "flash_4n.yaml").recipe).to_dict()
    fp8 = time_plan(load_recipe(RECIPES / "flash_4n.yaml", ["precision.fp8_recipe=blockwise",
                                                            "precision.fp8_dispatch=false"]).recipe).to_dict()
    assert bf16["assumptions"]["fp8_recipe"] == "none" and fp8["assumptions"]["fp8_recipe"] == "blockwise"
    assert not fp8["assumptions"]["fp8_dispatch"]
    assert fp8["total"] == bf16["total"]
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), "precision.fp8_recipe=blockwise"])
    text = " ".join(out.split())
    assert exc is None and "precision.fp8_recipe=blockwise's compute is priced as bf16" in text
    assert "EP rows into the experts are priced as e4m3" not in text  # precision.fp8_dispatch is opt-in
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), "precision.fp8_recipe=blockwise",
                                "precision.fp8_dispatch=true"])
    assert exc is None and "EP rows into the experts are priced as e4m3" in " ".join(out.split())
    # the memory plan has no FP8 terms either, and says what FP8's peak measured above bf16's
    assert "precision.fp8_recipe=blockwise: activations and transients are priced as bf16" in text
    assert "the FP8 peak was 8.9 GiB above bf16's (58.7 -> 67.6 GiB" in text
    # and names the stages that would not fit with that margin: flash_4n's 1M stage plans 138.0 of 139.8 GiB
    assert ("with that margin these stages would not fit (a note: V4-MEMORY does not add it): sparse_1m (138.0 + 8.9 "
            "> 139.8 GiB). Fix: more nodes (cluster.nodes), or precision.fp8_recipe=none") in text  # offload is on
    assert "sparse_64k (" not in text
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml")])
    assert exc is None and "priced as bf16" not in " ".join(out.split())


@pytest.mark.parametrize("edits, applies", [
    ({}, True),
    ({"precision.fp8_dispatch": False}, False),
    ({"precision.fp8_recipe": "none"}, False),
    ({"parallel.ep": 1}, False),
    ({"precision.dtype": "fp32"}, False),
])
def test_fp8_dispatch_prices_the_rows_into_the_experts_at_e4m3(edits, applies):
    """Under FP8 with EP, a routed row costs dim + 4 bytes into the experts and 2 dim back, per pass, instead of
    2 x 2 dim: flash_4n's EP term shrinks by exactly that ratio, the compute and the other terms do not move."""
    base = load_recipe(RECIPES / "flash_4n.yaml", []).recipe
    recipe = with_edits(base, {"precision.fp8_recipe": "blockwise", "precision.fp8_dispatch": True, **edits})
    plain, fp8 = stage_time(base, 2), stage_time(recipe, 2)
    if "parallel.ep" in edits:
        plain = stage_time(with_edits(base, {"parallel.ep": 1}), 2)
    dim = base.model.dim
    ratio = (dim + 4 + 2 * dim) / (4 * dim) if applies else 1.0
    assert fp8.ep_s == pytest.approx(plain.ep_s * ratio, rel=1e-12)
    assert (fp8.cp_s, fp8.dp_s) == (plain.cp_s, plain.dp_s)
    if "precision.dtype" not in edits:
        assert fp8.compute_s == plain.compute_s
    assert time_plan(recipe).fp8_dispatch is applies


def test_durations_read_the_same_in_every_report():
    from v4launch.validators.time_plan import duration_text

    cases = {0.34: "0.3 s", 9.94: "9.9 s", 9.96: "10 s", 42.2: "42 s", 360: "6 min", 3.2 * 3600: "3.2 h",
             12.4 * 86400: "12.4 d"}
    assert {s: duration_text(s) for s in cases} == cases
