"""Storage and offload rules: host offload needs whole-layer recompute; the node's host memory holds what it is given."""

from __future__ import annotations

from ..memory_plan import GIB, PlanUnavailable, memory_plan
from ..memory_storage import HOST_BYTES_PER_RANK, host_bytes_per_node
from .base import Context, rule


@rule("V4-OFFLOAD-RECOMPUTE", fields=("parallel.cpu_offloading", "parallel.recompute_granularity"), scope="recipe",
      fix="set parallel.recompute_granularity=full parallel.recompute_modules=[]")
def check_offload_recompute(ctx: Context):
    """parallel.cpu_offloading moves the layer inputs whole-layer recompute keeps; it needs recompute_granularity=full.

    Source: model/parallel/offload.py (saved-tensor hooks around each recomputed layer); Megatron-LM cpu_offloading.
    """
    p = ctx.parallel
    if not p.cpu_offloading:
        return ctx.na("parallel.cpu_offloading=false")
    if p.recompute_granularity != "full":
        graph = " compile.cuda_graph=false" if ctx.recipe.compile.cuda_graph else ""  # whole: V4-CUDA-GRAPH too
        return ctx.finding("parallel.cpu_offloading", True, "parallel.cpu_offloading=true with "
                           f"recompute_granularity={p.recompute_granularity}: only whole-layer recompute leaves each "
                           "layer with one input to move to host memory",
                           f"set parallel.recompute_granularity=full parallel.recompute_modules=[]{graph}, or "
                           "parallel.cpu_offloading=false")
    return ctx.ok("parallel.cpu_offloading", True, "layer inputs in pinned host memory between forward and backward")


@rule("V4-HOST-MEMORY", fields=("cluster.host_memory_gib", "parallel.cpu_offloading", "cluster.gpus_per_node"),
      fix="set cluster.host_memory_gib to the nodes' RAM, more context parallelism for the stage, or "
          "parallel.cpu_offloading=false where the GPU holds the stage")
def check_host_memory(ctx: Context):
    """A node's ranks fit its host memory: pinned offloaded layer inputs plus a per-process allowance.

    Source: validators/memory_plan.py (MemoryPlan.host_offload_bytes); HOST_BYTES_PER_RANK.
    """
    c = ctx.recipe.cluster
    if c.host_memory_gib is None and not ctx.parallel.cpu_offloading:
        return ctx.na("no host offload and cluster.host_memory_gib unset")
    try:
        plan = memory_plan(ctx.recipe, ctx.index)
    except PlanUnavailable as exc:
        return ctx.na(f"no memory plan: {exc}")
    need = host_bytes_per_node(ctx.recipe, plan)
    what = (f"{need / GIB:.0f} GiB per node: {c.gpus_per_node} ranks x ({plan.host_offload_bytes / GIB:.1f} GiB "
            f"offloaded + {HOST_BYTES_PER_RANK / GIB:.0f} GiB per process)")
    if c.host_memory_gib is None:
        return ctx.na(f"{what}; not checked (cluster.host_memory_gib unset)")
    if need > c.host_memory_gib * GIB:
        return ctx.finding("cluster.host_memory_gib", c.host_memory_gib,
                           f"stage {ctx.stage.name} needs {what} > {c.host_memory_gib:g} GiB")
    return ctx.ok("cluster.host_memory_gib", c.host_memory_gib, what)
