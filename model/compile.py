"""Regional compilation: each decoder block (and MTP block) ``torch.compile``d on its own.

Issue 17 ("regional compilation"); the same per-block scheme as torchtitan's
``apply_compile`` (one compiled region per transformer block, so the eight identical blocks
share compiled code and compile time stays that of one block). ``nn.Module.compile`` compiles
in place: parameter names, state dicts and checkpoints are unchanged, and the blocks are found
by type, wherever the model keeps them (a ``ModuleList`` or a ``ModuleDict`` of a pipeline stage).

Graph breaks remain where a block leaves tensor land, so the default is ``fullgraph=False``; the
pieces between them (norms, mHC, RoPE, SwiGLU, router, casts) become fused kernels:

* the sequence balance loss (``moe.sequence_balance_loss``, ``torch.compiler.disable``d: inductor once
  computed it wrong on the H200) and the warm-up KL (``kernels.layer._warmup_kl``, ``torch.compiler.disable``d:
  its chunks' entry ranges are host ints, read once per call; traced, it broke the graph twice per chunk and
  recompiled for each new range); the Triton attention, indexer and KL kernels are NOT breaks: their
  entry points (``kernels.triton_attention.sparse_sink_attention``, ``head_avg_probs``,
  ``kernels.triton_indexer.indexer_topk``, ``kernels.triton_student.student_scores``) call custom
  operators (``torch.ops.v4launch.*``) that the graph calls as opaque operations, so dynamo never traces
  into a kernel (traced, Triton refused the kernel: a Python float argument became fp64) and a CSA block
  keeps one graph instead of splitting around each kernel call;
* host-side ranges (the reference path's attention chunks and indexer row ranges), and the per-expert loop of the CPU / float32 expert path (split sizes read on the host).

Recompilation: the blocks share code, so dynamo keeps one cache entry per kind of block (SWA with
a hash router, CSA with an indexer, HCA, MTP, and the first layer of each kind, which fills the
batch's RoPE / plan caches): six entries of the attention code on the benchmark model, within
dynamo's default limit of 8. Nothing specialises on the layer id (``kernels.layer.gather_label``). A run
goes through several phases and kernel backends (each a new entry), so the job raises the limit
(:data:`RECOMPILE_LIMIT`) when the recipe compiles (``compile.enable``).

Recompute (``model/parallel/recompute.py``): dynamo does not trace into ``torch.utils.checkpoint``'s
replay (the region's body holds Python state: the replay counter, the expert counts put back), so a
compiled block would run its recomputed regions eagerly, and a block under whole-layer recompute
(``full``) would run eagerly throughout. Each recomputed region's own method is compiled instead and
registered on its module (``recompute.COMPILED_REGIONS``): the checkpoint calls the compiled code in
the forward and again in the replay. A block whose ``forward`` is itself recomputed is not compiled
around the checkpoint (nothing there to fuse).
"""

from __future__ import annotations

import torch
from torch import nn

from .parallel.recompute import COMPILED_REGIONS

RECOMPILE_LIMIT = 64
"""dynamo's per-code-object cache entries :func:`compile_blocks` allows (dynamo's default is 8): block kinds
(SWA, CSA, HCA, MTP, hash-routed) x phases x kernel backends."""


def keep_graph_order() -> None:
    """Make dynamo pick a frame's compiled graph by first match in compile order (process-wide).

    By default dynamo moves the entry it last used to the front of a frame's cache, so when two entries
    accept the same inputs (a static-shape entry and the dynamic-shape one compiled after it), which one
    runs depends on the layers run since. A recompute replay must run the graph its forward ran (the
    checkpoint matches their saved tensors one by one; torch's CheckpointError otherwise): with the
    order fixed, and the replay seeing the forward's tables (``BatchContext.as_of``), it does.
    Raises:
        NotImplementedError: this torch has no switch for it (``torch._C._dynamo.eval_frame._set_lru_cache``).
    """
    switch = getattr(torch._C._dynamo.eval_frame, "_set_lru_cache", None)
    if switch is None:
        raise NotImplementedError(f"torch {torch.__version__} cannot fix dynamo's graph order, which compiled "
                                  "regions under recompute need. Fix: set compile.enable=false, or "
                                  "parallel.recompute_granularity=null, or use torch >= 2.11.")
    switch(False)


def toolchain_problem(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot generate code for ``device`` here, or None.

    inductor compiles C++ for a CPU (the compiler it searches: ``torch._inductor.config.cpp.cxx``, or
    ``$CXX``); without one the first compiled forward fails deep inside the step. Other backends and
    GPUs (inductor writes Triton there) need nothing checked here.
    """
    if backend != "inductor" or device.type != "cpu":
        return None
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - inductor raises its own error types for a missing compiler
        return f"inductor generates C++ for the CPU but found no C++ compiler ({type(exc).__name__}: {exc})"
    return None


def compile_blocks(model: nn.Module, *, fullgraph: bool = False, backend: str = "inductor",
                   dynamic: bool | None = None) -> int:
    """``torch.compile`` every ``Block`` (decoder and MTP layers) of ``model`` in place.

    A block (or a module inside it) under recompute gets its recomputed methods compiled instead, as the
    module docstring says. Compiling a block twice is harmless (the second call replaces the first).

    Args:
        fullgraph: fail on a graph break instead of splitting the block there.
        backend: a torch.compile backend ("inductor" on GPUs and CPUs with a C++ compiler; "aot_eager"
            traces forward and backward without code generation).
        dynamic: torch.compile's shape policy (None: recompile once with dynamic shapes if they change).
    Returns:
        the number of blocks compiled.
    Raises:
        ValueError: ``model`` holds no Block (e.g. a pipeline stage with only the head).
    """
    from .model import Block  # noqa: PLC0415  (model.py imports the model files; this file is optional)

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise ValueError(f"compile_blocks: {type(model).__name__} holds no Block to compile. "
                         "Fix: pass the V4Model (or a pipeline stage that holds decoder layers).")
    options = dict(fullgraph=fullgraph, backend=backend, dynamic=dynamic)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if any(getattr(type(m), "_v4_recompute_attrs", ()) for b in blocks for m in b.modules()):
        keep_graph_order()
    for block in blocks:
        for module in block.modules():
            regions = getattr(type(module), "_v4_recompute_attrs", ())
            if regions:
                base = type(module)._v4_recompute_base
                module.__dict__[COMPILED_REGIONS] = {
                    name: torch.compile(getattr(base, name), **options) for name in regions}  # called as f(module, ...)
        if "forward" not in getattr(type(block), "_v4_recompute_attrs", ()):
            block.compile(**options)
    return len(blocks)
