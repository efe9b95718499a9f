"""Where ``compile.cuda_graph`` can capture the step, and which stages then run without a graph."""

from __future__ import annotations

from ..derived import graph_free_reason
from .base import Context, rule


@rule("V4-CUDA-GRAPH", fields=("compile.cuda_graph", "precision.dtype", "parallel.cpu_offloading", "cluster.gpu", "parallel.pp",
                               "parallel.cp", "parallel.ep", "parallel.distributed_optimizer", "curriculum.stages.*.cp",
                               "attention.kernel_backend", "curriculum.stages.*.kernel_backend"),
      fix="set compile.cuda_graph=false, or run the stage with pp, cp and ep 1 and without the distributed optimizer")
def check_cuda_graph(ctx: Context):
    """compile.cuda_graph needs one GPU per replica and bf16; each stage says whether it replays a captured step.

    A captured step holds one GPU's whole forward and backward: no pp, cp or ep collectives and no FSDP hooks
    inside it. Stages on the reference or cudnn kernels run eagerly; on triton every phase is captured, the
    warm-up's dense KL included (its query chunks come from host ints: model/kernels/layer.static_chunks).

    Source: torch.cuda.graphs (a captured region must not synchronise with the host, and its collectives
    would be replayed on fixed buffers); training/graph_step.py (what the job captures).
    """
    if not ctx.recipe.compile.cuda_graph:
        return ctx.na("compile.cuda_graph=false")
    refused = _unsupported_setting(ctx) or _split_step(ctx)
    if refused:
        return refused
    reason = graph_free_reason(ctx.backend)
    if reason:  # the backend decided: its field (a stage's own override or the recipe-wide one) is the one to cite
        return ctx.ok(ctx.backend_field, ctx.backend, f"stage '{ctx.stage.name}' runs without a graph under "
                      f"compile.cuda_graph=true: {reason}")
    return ctx.ok("compile.cuda_graph", True, f"stage '{ctx.stage.name}' replays one captured micro-batch step")


def _unsupported_setting(ctx: Context):
    """The finding for a CPU run or float32 compute, else None."""
    r = ctx.recipe
    if r.cluster.gpu == "cpu":
        return ctx.finding("cluster.gpu", "cpu", "compile.cuda_graph=true on cluster.gpu=cpu: CUDA graphs need a GPU",
                           "set compile.cuda_graph=false for a CPU run")
    if r.parallel.cpu_offloading:  # each alternative whole: offload also needs whole-layer recompute (V4-OFFLOAD-RECOMPUTE)
        full = "" if r.parallel.recompute_granularity == "full" else \
            " parallel.recompute_granularity=full parallel.recompute_modules=[]"
        return ctx.finding("parallel.cpu_offloading", True, "compile.cuda_graph=true with parallel.cpu_offloading="
                           "true: the host copies and their events cannot be captured in a graph",
                           f"set parallel.cpu_offloading=false, or compile.cuda_graph=false{full}")
    if r.precision.dtype != "bf16":
        return ctx.finding("precision.dtype", r.precision.dtype, f"compile.cuda_graph=true with precision.dtype="
                           f"{r.precision.dtype}: the routed experts then run one matmul per expert, whose row "
                           "counts are read on the host (model/moe.py run_local_experts); the grouped GEMM is bf16",
                           "set precision.dtype=bf16, or compile.cuda_graph=false")
    return None


def _split_step(ctx: Context):
    """The finding when the stage spreads one replica over GPUs (pp, cp, ep, the distributed optimizer), else None."""
    par = ctx.parallel
    blocking = [(f, v, 1) for f, v in (("parallel.pp", par.pp), (ctx.cp_field, ctx.cp), ("parallel.ep", par.ep))
                if v > 1]
    if par.distributed_optimizer:
        blocking.append(("parallel.distributed_optimizer", True, "false"))
    if not blocking:
        return None
    what = ", ".join(f"{name}={value}" for name, value, _ in blocking)
    undo = " ".join(f"{name}={one}" for name, _, one in blocking)
    r = ctx.recipe
    for i, st in enumerate(r.curriculum.stages):  # the other stages' cp too: one alternative for the whole recipe
        cp_field = f"curriculum.stages.{i}.cp" if st.cp is not None else "parallel.cp"
        if r.stage_cp(st) > 1 and f"{cp_field}=1" not in undo.split():
            undo += f" {cp_field}=1"
    if par.pp > 1 and par.pp_layout is not None:  # one stage needs no layout (V4-PP-LAYOUT, V4-PP-VPP)
        undo += " parallel.vpp=1 parallel.pp_layout=null" if par.vpp > 1 else " parallel.pp_layout=null"
    return ctx.finding(blocking[0][0], blocking[0][1], f"compile.cuda_graph=true with {what} in stage "
                       f"'{ctx.stage.name}': the captured step holds one GPU's forward and backward; pipeline sends, "
                       "context-parallel gathers, expert all-to-alls and FSDP's gathers would run inside it",
                       f"set compile.cuda_graph=false, or {undo} (one GPU per model replica)")


@rule("V4-CUDA-GRAPH-UNUSED", fields=("compile.cuda_graph", "attention.kernel_backend", "curriculum.stages.*.phase"),
      scope="recipe", severity="warning", fix="set attention.kernel_backend=triton, or compile.cuda_graph=false")
def check_cuda_graph_used(ctx: Context):
    """compile.cuda_graph=true captures nothing when every stage runs without a graph.

    Source: validators/derived.py graph_free_reason (the per-stage decision of V4-CUDA-GRAPH and of the job).
    """
    r = ctx.recipe
    if not r.compile.cuda_graph:
        return ctx.na("compile.cuda_graph=false")
    eager = [st.name for st in r.curriculum.stages if graph_free_reason(
        st.kernel_backend or r.attention.kernel_backend)]
    if len(eager) == len(r.curriculum.stages):
        fix = ("set compile.cuda_graph=false (a CPU run has no graph to capture)" if r.cluster.gpu == "cpu"
               else "set attention.kernel_backend=triton, or compile.cuda_graph=false")
        return ctx.finding("compile.cuda_graph", True, "compile.cuda_graph=true, but no stage is captured: every "
                           f"stage ({', '.join(eager)}) runs without a graph (`v4launch explain V4-CUDA-GRAPH`)", fix)
    return ctx.ok("compile.cuda_graph", True, f"{len(r.curriculum.stages) - len(eager)} of "
                  f"{len(r.curriculum.stages)} stages replay a captured step")
