"""Physical and plausible upper bounds of recipe numbers, each with its reason.

A bound here is not a tuning opinion: every value is far above any published or shipped run, and
below the point where a number stops meaning anything to the job (an index that no longer fits
the integer type the kernels use, a budget no cluster can spend, a report figure of 10^21 TiB).
Field descriptions cite the bound, so the error for ``seq_len: 1e30`` names the limit and why.
"""

from __future__ import annotations

MAX_SEQ_LEN = 1 << 24
"""16,777,216 tokens per packed sequence: 16× the released 1,048,576-token context. With
``MAX_MICRO_BATCH`` sequences per micro-batch the packed token positions stay below 2^31, the
range of the int32 position, range and top-k index tensors of the attention kernels."""

MAX_MICRO_BATCH = 64
"""Packed sequences per micro-batch per rank (THD packing uses 1); 64 · MAX_SEQ_LEN = 2^30 < 2^31."""

MAX_GLOBAL_BATCH = 1 << 24
"""Packed sequences per optimizer step: about 1000× the largest published pre-training batches."""

MAX_TOKENS = 1 << 50
"""Token budget of one stage (~1.1e15): about 30× the largest published pre-training corpus (~36e12
tokens); every token count and step · batch product stays exact in float64 and int64."""

MAX_STEPS = (1 << 31) - 1
"""Optimizer steps of one stage (int32 max: 68 years at one step per second)."""

MAX_DEGREE = 1 << 20
"""Any parallel size (tp, pp, vpp, cp, ep) and node count: about a million ranks, more than any cluster holds."""

MAX_GPUS_PER_NODE = 128
"""Accelerators (or CPU processes) per node."""

MAX_LAYERS = 1024
"""Decoder layers (released V4-Pro: 61)."""

MAX_MTP_DEPTH = 16
"""MTP layers (released: 1)."""

MAX_WIDTH = 1 << 17
"""Hidden size, expert width, low-rank dims (released V4-Pro dim: 7168)."""

MAX_HEADS = 1 << 12
"""Attention or indexer heads (released: 64 / 128)."""

MAX_HEAD_DIM = 1 << 12
"""Head dims (released: 512 main, 128 indexer)."""

MAX_VOCAB = 1 << 24
"""Vocabulary size (released: 129,280); token ids stay far inside int32."""

MAX_EXPERTS = 1 << 14
"""Routed experts per MoE layer: ~40× the largest released MoE (384); expert ids and per-expert
token counts stay small tensors."""

MAX_SHARED_EXPERTS = 64
"""Always-on shared experts (released: 1)."""

MAX_SEED = (1 << 32) - 1
"""Seeds: numpy's seed range (``seed_everything`` seeds numpy, which refuses larger or negative seeds)."""

MAX_ROPE_THETA = 1e12
"""RoPE bases (released: 1e4 and 1.6e5)."""

MAX_RESTARTS = 10_000
"""Slurm restarts of one run."""

MAX_NAME_CHARS = 128
"""Recipe and stage names: they become directory names (255-byte file-name limit)."""

MAX_TEXT_CHARS = 4096
"""Free-text and path fields."""

MAX_LIST_ITEMS = 4096
"""Entries of list fields other than compress_ratios (paths, mounts, setup lines, stages)."""
