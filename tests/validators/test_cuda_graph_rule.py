"""V4-CUDA-GRAPH: where ``compile.cuda_graph`` can capture the step, what each stage then does, and that the
job decides exactly as the validator says (``training/graph_step.stage_graph_plan``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from validate_helpers import RECIPES, validate_file
from v4launch.recipe_loading import load_recipe

GRAPH = ["compile.cuda_graph=true"]


def _graph_results(report):
    return {s.name: r for s in report.stages for r in s.results if r.rule_id == "V4-CUDA-GRAPH"}


def test_one_gpu_bf16_recipe_passes_and_each_stage_says_whether_it_replays():
    report = validate_file(RECIPES / "bench_h200.yaml", GRAPH)
    assert report.ok, [(v.rule_id, v.message) for v in report.violations]
    notes = {name: r.note for name, r in _graph_results(report).items()}
    assert "replays one captured micro-batch step" in notes["dense_4k"]
    assert "replays one captured micro-batch step" in notes["sparse_4k"]
    # the warm-up's dense KL on triton takes its row chunks from host ints (layer.static_chunks): captured too
    assert "replays one captured micro-batch step" in notes["warmup_4k"]
    # on the reference kernels (chunk ranges read on the host) no stage is captured, and each says why
    eager = _graph_results(validate_file(RECIPES / "bench_h200.yaml", [*GRAPH, "attention.kernel_backend=reference"]))
    assert all("runs without a graph" in r.note and "on the host" in r.note for r in eager.values()), eager
    assert all((r.field, r.value) == ("attention.kernel_backend", "reference") for r in eager.values())
    # a stage's own backend decides that stage alone, and its row cites that override
    one = _graph_results(validate_file(RECIPES / "bench_h200.yaml",
                                       [*GRAPH, "curriculum.stages.1.kernel_backend=reference"]))
    assert (one["warmup_4k"].field, one["warmup_4k"].value) == ("curriculum.stages.1.kernel_backend", "reference")
    assert "runs without a graph" in one["warmup_4k"].note
    assert one["sparse_4k"].field == "compile.cuda_graph" and "replays" in one["sparse_4k"].note


@pytest.mark.parametrize("over,field,value", [
    (["parallel.ep=2", "cluster.gpus_per_node=2", "parallel.global_batch_size=4"], "parallel.ep", 2),
    (["parallel.distributed_optimizer=true", "cluster.gpus_per_node=2", "parallel.global_batch_size=4"],
     "parallel.distributed_optimizer", True),
    (["precision.dtype=fp32"], "precision.dtype", "fp32"),
])
def test_settings_the_captured_step_cannot_hold_are_refused_naming_the_field_and_the_fix(over, field, value):
    report = validate_file(RECIPES / "bench_h200.yaml", [*GRAPH, *over])
    mine = [v for v in report.violations if v.rule_id == "V4-CUDA-GRAPH"]
    assert mine, [(v.rule_id, v.message) for v in report.violations]
    assert all(v.field == field and v.value == value for v in mine), [(v.field, v.value) for v in mine]
    assert all("compile.cuda_graph=false" in v.fix for v in mine)


def test_a_cpu_recipe_with_a_graph_is_refused():
    report = validate_file(RECIPES / "tiny_cpu.yaml", ["compile.cuda_graph=true"])
    mine = [v for v in report.violations if v.rule_id == "V4-CUDA-GRAPH"]
    assert mine and mine[0].field == "cluster.gpu" and "need a GPU" in mine[0].message


def test_memory_fixes_that_split_the_step_turn_the_graph_off():
    """A proposed fix must validate: where it adds ep / pp / cp / the distributed optimizer to a recipe that
    captures its step, it also sets compile.cuda_graph=false."""
    report = validate_file(RECIPES / "bench_h200.yaml", [*GRAPH, "cluster.gpu_memory_gib=20"])
    fixes = [v.fix for v in report.violations if v.rule_id == "V4-MEMORY"]
    assert fixes and all("compile.cuda_graph=false" in f for f in fixes), fixes


def test_the_job_decides_as_the_validator(monkeypatch):
    """stage_graph_plan (what the job does) against the rule's per-stage notes, on what the device runs."""
    torch = pytest.importorskip("torch")
    from v4launch.training.graph_step import stage_graph_plan

    recipe = load_recipe(RECIPES / "bench_h200.yaml", GRAPH).recipe
    gpu = torch.device("cuda", 0)
    notes = {name: r.note for name, r in _graph_results(validate_file(RECIPES / "bench_h200.yaml", GRAPH)).items()}
    for stage in recipe.curriculum.stages:
        backend = stage.kernel_backend or recipe.attention.kernel_backend
        plan = SimpleNamespace(name=stage.name, phase=stage.phase)
        use, text = stage_graph_plan(recipe, plan, backend, gpu)
        assert use == ("replays" in notes[stage.name]), (stage.name, text, notes[stage.name])
        assert stage.name in text
    # the device runs the reference kernels although triton was asked for (no SM90 GPU): no graph
    use, text = stage_graph_plan(recipe, SimpleNamespace(name="s", phase="sparse"), "reference", gpu)
    assert not use and "reference attention" in text
    use, text = stage_graph_plan(recipe, SimpleNamespace(name="s", phase="sparse"), "triton", torch.device("cpu"))
    assert not use and "cpu" in text


def test_the_memory_plan_keeps_a_captured_stages_gradients():
    """Without a graph, one micro-batch per step: the gradients appear as backward frees activations (the plan
    counts what exceeds them). A captured stage's gradient tensors live through the forward: counted whole."""
    from v4launch.validators.memory_plan import memory_plan

    eager = load_recipe(RECIPES / "bench_h200.yaml", ["compile.cuda_graph=false"]).recipe
    graph = load_recipe(RECIPES / "bench_h200.yaml", GRAPH).recipe
    for index in range(len(graph.curriculum.stages)):  # every stage, the warm-up included, is captured
        e, g = memory_plan(eager, index), memory_plan(graph, index)
        grads, params = g.term("gradients").bytes, g.term("parameters").bytes  # parameters: + a few buffers
        assert 0.95 * params <= grads <= params and grads > e.term("gradients").bytes
        assert g.total_bytes > e.total_bytes



def test_a_graph_that_captures_no_stage_warns():
    report = validate_file(RECIPES / "bench_h200.yaml", [*GRAPH, "attention.kernel_backend=reference"])
    unused = [w for w in report.warnings if w.rule_id == "V4-CUDA-GRAPH-UNUSED"]
    assert unused and "no stage is captured" in unused[0].message and "kernel_backend=triton" in unused[0].fix
    assert not [w for w in validate_file(RECIPES / "bench_h200.yaml", GRAPH).warnings
                if w.rule_id == "V4-CUDA-GRAPH-UNUSED"]


def test_a_graph_on_a_cpu_recipe_is_told_to_turn_it_off_not_to_change_kernels():
    """On cluster.gpu=cpu the Triton kernels cannot run either (V4-KERNEL-SM90): the one whole fix is to drop the
    graph, and applying it leaves no graph finding."""
    report = validate_file(RECIPES / "tiny_cpu.yaml", ["compile.cuda_graph=true"])
    (unused,) = [w for w in report.warnings if w.rule_id == "V4-CUDA-GRAPH-UNUSED"]
    assert "compile.cuda_graph=false" in unused.fix and "triton" not in unused.fix
    fixed = validate_file(RECIPES / "tiny_cpu.yaml", ["compile.cuda_graph=false"])
    assert not [f for f in [*fixed.violations, *fixed.warnings] if f.rule_id.startswith("V4-CUDA-GRAPH")]
