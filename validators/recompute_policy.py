"""Which activation-recompute settings the bundled job applies (``parallel.recompute_*``), in pure Python.

One source for the validator's rules (V4-RECOMPUTE refuses, V4-RECOMPUTE-REPLAY warns), the memory plan
and the job's seam (``model/parallel/recompute.py`` applies :func:`recompute_regions`' names).

Spec: seed 000 §10 ("generic checkpoint_core_attention is rejected by V4 hybrid attention"; "an outer
recompute boundary that encloses boundary exchange or compressed all-gathers would replay communication
during backward. Any future recompute policy should therefore be evaluated in end-to-end step time");
Megatron's names and defaults (transformer_config.py ``recompute_granularity``, ``recompute_modules``,
default ``['core_attn']``; reference/megatron-v4-contract.md §A item 17 and B3). The measured anchors of
V4-Flash training (reference/parallel-and-throughput.md) run ``recompute_granularity=full``.

Granularity:

* ``none``: nothing recomputed (modules must be empty: they would be ignored).
* ``selective``: the named regions of :data:`REGIONS` in every decoder block and MTP layer.
* ``full``: every decoder block and MTP layer whole (``Block.forward``): only its input streams
  [rows, hc, dim] stay between forward and backward, and one layer at a time is recomputed in backward
  (Megatron ``recompute_method=uniform, recompute_num_layers=1``). ``recompute_modules`` must be empty.

A region that encloses collectives (``full`` at cp > 1: the CP boundary exchange and the compressed
all-gathers; ``full`` or ``moe`` at ep > 1: the expert all-to-all; ``full`` or ``moe`` at cp > 1: the
balance loss's CP sums) replays them in backward. That is correct (every rank of the group replays the same
collectives in the same order) and costs time, so it is accepted and reported as a warning
(:func:`replayed_collectives`), as seed 000 §10 asks: measure the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

FIELD = "parallel.recompute_modules"
GRANULARITY = "parallel.recompute_granularity"
FULL_LAYER = "full"
"""The region name :func:`recompute_regions` returns for granularity ``full`` (the whole layer)."""


@dataclass(frozen=True)
class Region:
    """What a ``recompute_modules`` name means in this model.

    Attributes:
        meaning: the region it recomputes (or why it is refused).
        refused: why the name is never accepted (None: accepted).
        collectives: the region encloses the balance loss's CP sums (cp > 1) or the expert all-to-all (ep > 1).
    """

    meaning: str
    refused: str | None = None
    collectives: bool = False


REGIONS: dict[str, Region] = {
    "core_attn": Region("the core attention (window + compressed-entry softmax) of every layer",
                        refused="'core_attn' recompute is rejected by V4 hybrid attention (it sits between the CP "
                                "boundary exchange and the compressed all-gather, and the attention path already "
                                "recomputes each query chunk's scores in backward)"),
    "layernorm": Region("attn_norm and ffn_norm of every block and MTP layer"),
    "mla_up_proj": Region("attn.project_query (wq_b up-projection, per-head RMS norm, RoPE) of every block "
                          "and MTP layer"),
    "moe_act": Region("the clamped SwiGLU activation (Expert.activation) of the routed and shared experts"),
    "shared_experts": Region("ffn.shared_experts of every block and MTP layer"),
    "moe": Region("the whole MoE layer (ffn: router, dispatch, experts, combine, balance loss)", collectives=True),
    "mlp": Region("Megatron's dense MLP",
                  refused="'mlp' recomputes a dense MLP, and every V4 FFN is a MoE (hash layers included), so it "
                          "would recompute nothing"),
}
"""Every name the recipe schema allows (``schema/parallel.py`` ``RecomputeModule``)."""

SELECTIVE_ALL = ("layernorm", "mla_up_proj", "moe_act", "shared_experts")
"""The selective regions that enclose no collective at any cp or ep."""

SELECTIVE_FIX = ("set parallel.recompute_granularity=selective and list modules from layernorm, mla_up_proj, "
                 "moe_act, shared_experts, moe (e.g. parallel.recompute_modules=[mla_up_proj]), or "
                 "parallel.recompute_granularity=full with no modules")


class RecomputeRefused(ValueError):
    """A recompute setting the job cannot honour: the field, its value, the rule's reason and the fix.

    ``str()`` is ``"<field>=<value>: V4-RECOMPUTE: <why>. Fix: <fix>"``.
    """

    def __init__(self, field: str, value: object, why: str, fix: str = SELECTIVE_FIX) -> None:
        self.field, self.value, self.why, self.fix = field, value, why, fix
        super().__init__(f"{field}={value!r}: V4-RECOMPUTE: {why}. Fix: {fix}")


def recompute_regions(granularity: str, modules: Iterable[str], *, n_shared_experts: int | None = None) -> list[str]:
    """The regions the job recomputes for ``parallel.recompute_granularity`` and ``parallel.recompute_modules``.

    Args:
        granularity: "none", "selective" or "full".
        modules: the recipe's module names (Megatron's, :data:`REGIONS`).
        n_shared_experts: ``model.moe.n_shared_experts`` when known (``shared_experts`` needs one).
    Returns:
        [] for none; the de-duplicated names in the order given for selective; [:data:`FULL_LAYER`] for full.
    Raises:
        RecomputeRefused: an unknown granularity or name; ``none`` or ``full`` with modules (ignored by
            Megatron, so refused here rather than silently dropped); ``selective`` without modules
            (Megatron then recomputes ``core_attn``); ``core_attn``; ``mlp``; ``shared_experts`` without
            shared experts.
    """
    names = list(dict.fromkeys(modules))
    if granularity not in ("none", "selective", "full"):
        raise RecomputeRefused(GRANULARITY, granularity, "must be none, selective or full", "use one of those")
    if granularity != "selective":
        if names:
            raise RecomputeRefused(FIELD, names, f"recompute_granularity={granularity}: these modules would be ignored",
                                   f"set parallel.recompute_granularity=selective, or drop {FIELD}")
        return [FULL_LAYER] if granularity == "full" else []
    if not names:
        raise RecomputeRefused(FIELD, [], "selective recompute without modules means ['core_attn'] in Megatron")
    for name in names:
        region = REGIONS.get(name)
        if region is None:
            raise RecomputeRefused(FIELD, names, f"{name!r} is not a recompute module name (known: {', '.join(REGIONS)})")
        if region.refused:
            raise RecomputeRefused(FIELD, names, region.refused)
    if "shared_experts" in names and n_shared_experts == 0:
        raise RecomputeRefused(FIELD, names, "'shared_experts' with model.moe.n_shared_experts=0: nothing to recompute",
                               f"drop 'shared_experts' from {FIELD}")
    return names


def replayed_collectives(regions: Iterable[str], *, max_cp: int, ep: int) -> list[str]:
    """The collectives that ``regions`` (from :func:`recompute_regions`) replay in backward.

    Args:
        regions: recomputed region names; max_cp: the largest CP size of any curriculum stage; ep: ``parallel.ep``.
    Returns:
        Human-readable collective kinds, e.g. ``["the CP boundary exchange and compressed all-gathers (cp=4)",
        "the expert all-to-all (ep=8)"]``; empty when nothing is replayed.
    """
    regions = set(regions)
    full = FULL_LAYER in regions
    out = []
    if full and max_cp > 1:
        out.append(f"the CP boundary exchange and compressed all-gathers (cp={max_cp})")
    if (full or "moe" in regions) and max_cp > 1:
        out.append(f"the balance loss's CP sums (cp={max_cp})")
    if (full or "moe" in regions) and ep > 1:
        out.append(f"the expert all-to-all (ep={ep})")
    return out
