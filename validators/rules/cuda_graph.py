"""Where ``compile.cuda_graph`` can capture the step, and which stages then run without a graph."""

from __future__ import annotations

from .base import Context, rule

GRAPH_FREE_REASONS = {
    "dense_kl": "its dense indexer KL reads query-chunk entry ranges on the host (kernels/layer.py warmup_chunks)",
    "reference": "the reference attention reads per-chunk entry ranges on the host",
    "cudnn": "the cudnn kernels are not checked free of host synchronisation (only triton's are)",
}
"""Why a stage runs its step without a CUDA graph; the job logs the same words (training/graph_step.py)."""


def graph_free_reason(phase: str, indexer_loss: str | None, backend: str) -> str | None:
    """Why a stage of ``phase`` / effective indexer loss / kernel backend runs eagerly under
    ``compile.cuda_graph`` (None: its step is captured). Shared by this rule and the job."""
    if backend != "triton":
        return GRAPH_FREE_REASONS[backend]
    if phase != "dense" and indexer_loss == "dense":
        return GRAPH_FREE_REASONS["dense_kl"]
    return None


@rule("V4-CUDA-GRAPH", fields=("compile.cuda_graph", "compile.enable", "precision.dtype", "cluster.gpu", "parallel.pp",
                               "parallel.cp", "parallel.ep", "parallel.distributed_optimizer", "curriculum.stages.*.cp"),
      fix="set compile.cuda_graph=false, or run the stage with pp, cp and ep 1 and without the distributed optimizer")
def check_cuda_graph(ctx: Context):
    """compile.cuda_graph captures one GPU's whole forward and backward: a GPU, bf16, no compiled blocks (yet), no
    pp, cp or ep collectives and no FSDP hooks inside the step; warm-up stages with the dense KL target and
    reference-kernel stages run eagerly (stated per stage).

    Source: torch.cuda.graphs (a captured region must not synchronise with the host, and its collectives
    would be replayed on fixed buffers); training/graph_step.py (what the job captures).
    """
    if not ctx.recipe.compile.cuda_graph:
        return ctx.na("compile.cuda_graph=false")
    par, r = ctx.parallel, ctx.recipe
    if r.cluster.gpu == "cpu":
        return ctx.finding("cluster.gpu", "cpu", "compile.cuda_graph=true on cluster.gpu=cpu: CUDA graphs need a GPU",
                           "set compile.cuda_graph=false for a CPU run")
    if r.precision.dtype != "bf16":
        return ctx.finding("precision.dtype", r.precision.dtype, f"compile.cuda_graph=true with precision.dtype="
                           f"{r.precision.dtype}: the routed experts then run one matmul per expert, whose row "
                           "counts are read on the host (model/moe.py run_local_experts); the grouped GEMM is bf16",
                           "set precision.dtype=bf16, or compile.cuda_graph=false")
    if r.compile.enable:
        return ctx.finding("compile.enable", True, "compile.cuda_graph=true with compile.enable=true: capturing the "
                           "compiled blocks failed on an H200 (CUDA 'operation not permitted when stream is "
                           "capturing' in the first, dense stage of recipes/bench_h200.yaml, 2026-12-02); the "
                           "uncompiled step's capture passes tests/training/test_cuda_graph_step.py",
                           "set compile.enable=false (the graph without compiled blocks) or compile.cuda_graph=false")
    blocking = [(f, v) for f, v in (("parallel.pp", par.pp), (ctx.cp_field, ctx.cp), ("parallel.ep", par.ep))
                if v > 1]
    if par.distributed_optimizer:
        blocking.append(("parallel.distributed_optimizer", True))
    if blocking:
        f, v = blocking[0]
        what = ", ".join(f"{name}={value}" for name, value in blocking)
        return ctx.finding(f, v, f"compile.cuda_graph=true with {what} in stage '{ctx.stage.name}': the captured "
                           "step holds one GPU's forward and backward; pipeline sends, context-parallel gathers, "
                           "expert all-to-alls and FSDP's gathers would run inside it")
    reason = graph_free_reason(ctx.stage.phase, ctx.stage.effective_indexer_loss, ctx.backend)
    if reason:
        return ctx.ok("compile.cuda_graph", True, f"stage '{ctx.stage.name}' runs without a graph: {reason}")
    return ctx.ok("compile.cuda_graph", True, f"stage '{ctx.stage.name}' replays one captured micro-batch step")
