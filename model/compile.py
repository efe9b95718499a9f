"""Regional compilation: each decoder block (and MTP block) ``torch.compile``d on its own.

Issue 17 ("regional compilation"); the same per-block scheme as torchtitan's
``apply_compile`` (one compiled region per transformer block, so the eight identical blocks
share compiled code and compile time stays that of one block). ``nn.Module.compile`` compiles
in place: parameter names, state dicts and checkpoints are unchanged, and the blocks are found
by type, wherever the model keeps them (a ``ModuleList`` or a ``ModuleDict`` of a pipeline stage).

Graph breaks remain where a block leaves tensor land, so the default is ``fullgraph=False``; the
pieces between them (norms, mHC, RoPE, SwiGLU, router, casts) become fused kernels:

* the Triton attention kernels: their entry points (``kernels.triton_attention.sparse_sink_attention``,
  ``head_avg_probs``, ``kernels.triton_indexer.indexer_topk``) are ``torch.compiler.disable``d, so
  dynamo never traces into a kernel (traced, Triton refused the kernel: a Python float argument
  became fp64) and the block's graph splits around each call;
* host-side ranges (the reference attention's chunks, the indexer's row ranges), and the
  per-expert loop of the CPU / float32 expert path (split sizes read on the host).

Recompilation: the blocks share code, so dynamo keeps one cache entry per kind of block (SWA with
a hash router, CSA with an indexer, HCA, MTP, and the first layer of each kind, which fills the
batch's RoPE / plan caches): six entries of the attention code on the benchmark model, within
dynamo's default limit of 8. Nothing specialises on the layer id (``kernels.layer.gather_label``).
"""

from __future__ import annotations

from torch import nn


def compile_blocks(model: nn.Module, *, fullgraph: bool = False, backend: str = "inductor",
                   dynamic: bool | None = None) -> int:
    """``torch.compile`` every ``Block`` (decoder and MTP layers) of ``model`` in place.

    Args:
        fullgraph: fail on a graph break instead of splitting the block there.
        backend: a torch.compile backend ("inductor" on GPUs; "aot_eager" traces without code generation).
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
    for block in blocks:
        block.compile(fullgraph=fullgraph, backend=backend, dynamic=dynamic)
    return len(blocks)
