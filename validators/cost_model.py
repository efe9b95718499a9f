"""Per-layer cost model for pipeline balance: forward FLOPs per token, from model dims and seq_len.

A multiply-add counts 2 FLOPs. S = the stage's packed sequence length (taken as one document,
the worst case for attention), W = window, H·d = heads × head dim, k = indexer top-k,
nih·dih = indexer heads × head dim. A causal query sees on average S/(2r) compressed entries
of ratio r. Backward is taken as a constant multiple of forward for every layer, so it
cancels out of the balance ratio. The symbols and formulas (documented in docs/validate.md):

* every decoder/MTP layer: projections 2·(dim·q_lora + q_lora·H·d + dim·d + H·d·o_lora
  + o_groups·o_lora·dim), mHC mixing 2 · 2·(hc·dim)·(2hc + hc²), MoE
  2·3·dim·inter·(active + shared) + router 2·dim·experts (hash layers: no router GEMM);
  core attention over n entries = 4·H·d·n (QK and PV, K = V).
* SWA (ratio 0): core over min(W, S).
* HCA (ratio 128): compressor 4·dim·d + core over W + S/256.
* CSA (ratio 4): compressor 8·dim·d (overlapping, two windows); dense phase: core over
  W + S/8 and no indexer; warmup/sparse: indexer 2·q_lora·nih·dih + 2·dim·nih + 8·dim·dih,
  scoring 2·nih·dih·S/8, core over W + min(k, S/8), and when the indexer loss is on the
  teacher logits 2·H·d·S/8 (warmup: dense target) or 2·H·d·k (sparse target).
* E: 0 (a gather). L: head 2·dim·vocab. m: 2·2·dim² (e_proj, h_proj) + its block + its own
  head 2·dim·vocab.
"""

from __future__ import annotations

from .layout import Layout, format_layout
from .schema.model import ModelConfig

PP_BALANCE_THRESHOLD = 1.25
"""Largest accepted max/mean cost ratio over virtual pipeline stages (``V4-PP-BALANCE``).

With this model the shipped 4-node Flash layout ``Et*10|t*12|t*12|t*9mL`` scores about 1.11
at 64K, while the layout it replaced (``Et*10|t*11|t*11|t*11mL``, seed 004 item 12: its last
stage "became the bubble") scores about 1.28 — the threshold separates the two.
"""


def _core(m: ModelConfig, entries: float) -> float:
    return 4.0 * m.n_heads * m.head_dim * entries


def _common(m: ModelConfig, hash_routed: bool) -> float:
    proj = 2.0 * (m.dim * m.q_lora_rank + m.q_lora_rank * m.n_heads * m.head_dim + m.dim * m.head_dim
                  + m.n_heads * m.head_dim * m.o_lora_rank + m.o_groups * m.o_lora_rank * m.dim)
    hc = m.mhc.hc_mult
    mhc = 2 * 2.0 * (hc * m.dim) * (2 * hc + hc * hc)
    e = m.moe
    moe = 2.0 * 3 * m.dim * e.moe_inter_dim * (e.n_activated_experts + e.n_shared_experts)
    router = 0.0 if hash_routed else 2.0 * m.dim * e.n_routed_experts
    return proj + mhc + moe + router


def attention_flops(m: ModelConfig, ratio: int, seq_len: int, phase: str, loss_on: bool) -> float:
    """Ratio-specific attention FLOPs per token (see the module docstring)."""
    w = min(m.window_size, seq_len)
    if ratio == 128:
        return 4.0 * m.dim * m.head_dim + _core(m, w + seq_len / 256)
    if ratio != 4:
        return _core(m, w)
    visible = seq_len / 8
    comp = 8.0 * m.dim * m.head_dim
    if phase == "dense":
        return comp + _core(m, w + visible)
    ix = m.indexer
    indexer = 2.0 * m.q_lora_rank * ix.n_heads * ix.head_dim + 2.0 * m.dim * ix.n_heads + 8.0 * m.dim * ix.head_dim
    scoring = 2.0 * ix.n_heads * ix.head_dim * visible
    core = _core(m, w + min(ix.topk, visible))
    teacher = 0.0
    if loss_on:
        teacher = 2.0 * m.n_heads * m.head_dim * (visible if phase == "warmup" else min(ix.topk, visible))
    return comp + indexer + scoring + core + teacher


def _ratio(m: ModelConfig, slot: int) -> int:
    """compress_ratios[slot], 0 when the list is too short (that is V4-RATIOS-LENGTH's to report)."""
    return m.compress_ratios[slot] if slot < len(m.compress_ratios) else 0


def unit_costs(m: ModelConfig, seq_len: int, phase: str, loss_on: bool) -> dict[str, list[float]]:
    """Cost of every layout unit, by symbol: {'E': [..], 't': [per decoder layer], 'm': [..], 'L': [..]}."""
    head = 2.0 * m.dim * m.vocab_size
    t = [_common(m, i < m.moe.n_hash_layers) + attention_flops(m, _ratio(m, i), seq_len, phase, loss_on)
         for i in range(m.n_layers)]
    mtp = [4.0 * m.dim * m.dim + _common(m, False) + head
           + attention_flops(m, _ratio(m, m.n_layers + j), seq_len, phase, loss_on) for j in range(m.mtp.depth)]
    return {"E": [0.0], "t": t, "m": mtp, "L": [head]}


def stage_costs(layout: Layout, units: dict[str, list[float]]) -> list[float]:
    """FLOPs per token of each virtual stage of ``layout`` (units beyond the model's count cost 0)."""
    seen = {s: 0 for s in units}
    out = []
    for stage in layout.stages:
        total = 0.0
        for sym in stage:
            costs = units.get(sym, [])
            total += costs[seen[sym]] if seen.get(sym, 0) < len(costs) else 0.0
            seen[sym] = seen.get(sym, 0) + 1
        out.append(total)
    return out


def balance_ratio(costs: list[float]) -> float:
    """max / mean of stage costs (1.0 = perfectly balanced)."""
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0


PROPOSAL_WORK_LIMIT = 20_000_000
"""Largest stages × layers² the layout proposal's dynamic programme takes on (real models: < 10⁵)."""


def propose_layout(units: dict[str, list[float]], n_stages: int, n_hash: int) -> str | None:
    """Min-max contiguous partition of the decoder layers into ``n_stages`` virtual stages.

    E and the hash-routed layers stay on the first stage, every m and L on the last; the
    layers in between are split by dynamic programming to minimise the costliest stage.
    None when the model is too large for the O(stages · layers²) search.
    """
    t = units["t"]
    if n_stages * (len(t) + 1) ** 2 > PROPOSAL_WORK_LIMIT:
        return None
    fixed = min(n_hash, len(t))
    first = sum(units["E"]) + sum(t[:fixed])
    last = sum(units["m"]) + sum(units["L"])
    free = t[fixed:]
    n = len(free)
    prefix = [0.0]
    for c in free:
        prefix.append(prefix[-1] + c)

    def seg(i: int, j: int, k: int) -> float:
        return prefix[j] - prefix[i] + (first if k == 0 else 0.0) + (last if k == n_stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(n + 1):
        best[0][j] = seg(0, j, 0)
    for k in range(1, n_stages):
        for j in range(n + 1):
            for i in range(j + 1):
                cand = max(best[k - 1][i], seg(i, j, k))
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    bounds, j = [n], n
    for k in range(n_stages - 1, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds = bounds[::-1]
    stages, start = [], 0
    for k, end in enumerate(bounds):
        body = ["t"] * (end - start + (fixed if k == 0 else 0))
        stages.append((["E"] if k == 0 else []) + body + (["m"] * len(units["m"]) + ["L"] if k == n_stages - 1 else []))
        start = end
    return format_layout(stages)
