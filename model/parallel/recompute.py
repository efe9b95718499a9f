"""Selective activation recompute (``parallel.recompute_modules``), applied to a built model from outside.

Spec: seed 000 §10 (activation memory; "an outer recompute boundary that encloses boundary
exchange or compressed all-gathers would replay communication during backward"); Megatron's
``recompute_modules`` names (transformer_config.py; reference/megatron-v4-contract.md §1 item 17
and B3). The recipe validator's rule V4-RECOMPUTE (validators/rules/attention.py) refuses
``core_attn``; this module refuses the same name with the same rule and fix, and refuses the
names this model cannot honour (see :data:`REGIONS`).

What each allowed name recomputes in this model (every decoder block and MTP layer):

================  ==============================================================  ==========================
name              region (checkpointed in backward)                               collectives inside
================  ==============================================================  ==========================
``layernorm``     ``attn_norm`` and ``ffn_norm`` (input and pre-MoE RMSNorm)      none
``mla_up_proj``   ``attn.project_query``: wq_b up-projection, per-head RMS, RoPE  none
``moe_act``       ``Expert.activation`` (clamped SwiGLU) of routed + shared       none
``shared_experts`` ``ffn.shared_experts`` (the whole shared expert)              none
``moe``           ``ffn`` (router, dispatch, experts, combine, balance loss)      CP sums of the balance
                                                                                  loss when cp > 1; the
                                                                                  expert all-to-all at ep > 1
================  ==============================================================  ==========================

Refused: ``core_attn`` (V4-RECOMPUTE: the core attention sits between the CP boundary exchange and
the compressed all-gather, and the attention path already recomputes each query chunk's scores
itself: ``BatchContext.recompute`` and the fused kernels' backward); ``mlp`` (Megatron recomputes
the *dense* MLP; every V4 FFN is a MoE, so the name would recompute nothing); ``moe`` when a
curriculum stage runs cp > 1 or ep > 1 (its region encloses collectives).

How: the module owning a region (the norm, the attention, the expert, the MoE) takes a subclass
of its own class whose region method (``forward``, ``Attention.project_query``,
``Expert.activation``) calls the original through ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` (FSDP2's ``fully_shard`` swaps classes the same way). No module is inserted
or renamed, so parameter FQNs and state-dict keys stay exactly the single-device ones
(``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.``). FSDP2's ``fully_shard`` applied afterwards per block
composes: its hooks run around the block's ``forward``, the recompute runs inside the block's
backward, after FSDP has gathered the block's parameters. Pipeline stages share their blocks
with the model they were cut from (``pipeline.cut_stage``), so apply this after the split to
each part; a region already under recompute is left as it is (applying twice is harmless).

The recompute of ``moe`` runs the MoE with ``training`` off, so the expert token counts of the
aux-loss-free balancing (``MoE.expert_counts``) are counted once per forward, not again in backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..moe import MoE
from .fsdp import decoder_blocks

FIELD = "parallel.recompute_modules"


@dataclass(frozen=True)
class Region:
    """What a ``recompute_modules`` name means here.

    Attributes:
        meaning: the region this name recomputes in the V4 model (or why it is refused).
        refused: the rule text when the name is never accepted (None: accepted).
        collectives: True when the region encloses a CP collective once cp > 1 (or the EP all-to-all at ep > 1).
    """

    meaning: str
    refused: str | None = None
    collectives: bool = False


REGIONS: dict[str, Region] = {
    "core_attn": Region("the core attention (window + compressed-entry softmax) of every layer",
                        refused="V4-RECOMPUTE: 'core_attn' recompute is rejected by V4 hybrid attention (it sits "
                                "between the CP boundary exchange and the compressed all-gather; the attention "
                                "path already recomputes each query chunk's scores in backward)"),
    "layernorm": Region("attn_norm and ffn_norm of every block and MTP layer"),
    "mla_up_proj": Region("attn.project_query (wq_b up-projection, per-head RMS norm, RoPE) of every block "
                          "and MTP layer"),
    "moe_act": Region("the clamped SwiGLU activation (Expert.activation) of the routed and shared experts"),
    "shared_experts": Region("ffn.shared_experts of every block and MTP layer"),
    "moe": Region("the whole MoE layer (ffn: router, dispatch, experts, combine, balance loss)", collectives=True),
    "mlp": Region("Megatron's dense MLP",
                  refused="V4-RECOMPUTE: 'mlp' recomputes a dense MLP, and every V4 FFN is a MoE (hash "
                          "layers included), so it would recompute nothing"),
}
"""Every name the recipe schema allows (``validators/schema/parallel.py`` ``RecomputeModule``)."""

_FIX = "list modules from layernorm, mla_up_proj, moe_act, shared_experts (e.g. parallel.recompute_modules=[mla_up_proj])"


def _refuse(value: Any, rule: str, fix: str = _FIX) -> ValueError:
    return ValueError(f"{FIELD}={value!r}: {rule}. Fix: {fix}")


def check_recompute_modules(modules: Iterable[str], *, max_cp: int = 1, ep: int = 1) -> list[str]:
    """The accepted, de-duplicated names of ``modules`` in the order given.

    Args:
        modules: names from ``parallel.recompute_modules``.
        max_cp: the largest context-parallel size of any curriculum stage of the run.
        ep: ``parallel.ep``.
    Raises:
        ValueError: a name outside :data:`REGIONS`, a refused name (``core_attn``, ``mlp``), or
            ``moe`` with max_cp > 1 or ep > 1; the message names the field, the value, the rule and the fix.
    """
    names = list(dict.fromkeys(modules))
    for name in names:
        region = REGIONS.get(name)
        if region is None:
            raise _refuse(names, f"{name!r} is not a recompute module name (known: {', '.join(REGIONS)})")
        if region.refused:
            raise _refuse(names, region.refused)
        if region.collectives and (max_cp > 1 or ep > 1):
            causes = [f"the balance loss's CP sums at cp={max_cp}"] * (max_cp > 1) + \
                [f"the expert all-to-all at ep={ep}"] * (ep > 1)
            raise _refuse(names, f"V4-RECOMPUTE: '{name}' recompute would enclose collectives ({' and '.join(causes)}) "
                                 "and replay them in backward", fix="drop 'moe' and list 'shared_experts' and 'moe_act' instead, or run "
                                                 "every curriculum stage at cp=1 and ep=1")
    return names


def modules_from_recipe(granularity: str, modules: Iterable[str], *, max_cp: int = 1, ep: int = 1) -> list[str]:
    """The names to recompute for ``parallel.recompute_granularity`` and ``parallel.recompute_modules``.

    "none" with no modules -> []; "selective" -> :func:`check_recompute_modules`.
    Raises:
        ValueError: "selective" without modules (Megatron then recomputes core_attn); "none" with
            modules (they would be ignored); "full" (the whole layer encloses the core attention
            and, at cp > 1, the CP boundary exchange and all-gathers); any error of
            :func:`check_recompute_modules`.
    """
    modules = list(modules)
    if granularity == "none":
        if modules:
            raise ValueError(f"parallel.recompute_granularity='none' with {FIELD}={modules!r}: the modules would be "
                             "ignored. Fix: set parallel.recompute_granularity=selective, or drop "
                             f"{FIELD}.")
        return []
    if granularity == "full":
        raise ValueError("parallel.recompute_granularity='full': V4-RECOMPUTE: recomputing whole layers encloses "
                         "the core attention and, at cp > 1, the CP boundary exchange and compressed all-gathers. "
                         f"Fix: set parallel.recompute_granularity=selective and {FIELD}=[layernorm, mla_up_proj, "
                         "moe_act, shared_experts] (or a subset).")
    if granularity != "selective":
        raise ValueError(f"parallel.recompute_granularity={granularity!r}: must be none, selective or full. "
                         "Fix: use one of those.")
    if not modules:
        raise _refuse([], "V4-RECOMPUTE: selective recompute without modules means ['core_attn'] in Megatron")
    return check_recompute_modules(modules, max_cp=max_cp, ep=ep)


_RECOMPUTE_CLASSES: dict[tuple[type, frozenset[str]], type] = {}


def _checkpointing(base: type, name: str, moe: bool) -> Callable:
    """A method that runs ``base.<name>`` (looked up at each call) under a non-reentrant checkpoint.

    ``moe``: the MoE forward: replay with ``training`` off (the expert counts are counted once). A
    ``moe`` region at cp > 1 or ep > 1 is refused once, by :func:`check_recompute_modules` (max_cp, ep).
    """

    @functools.wraps(getattr(base, name))
    def run(self, *args, **kwargs):
        method = getattr(base, name)
        calls = [0]

        def body(*a, **k):
            calls[0] += 1
            if calls[0] == 1 or not moe:
                return method(self, *a, **k)
            was, self.training = self.training, False  # a replay: count the experts' tokens once
            try:
                return method(self, *a, **k)
            finally:
                self.training = was

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


def _recompute_class(module: nn.Module, attr: str) -> type:
    """The class ``module`` takes so that ``attr`` (with those already recomputed) runs under checkpoint.

    A subclass of the module's own class whose recomputed methods call the original ones through
    ``torch.utils.checkpoint``; one class per (class, methods), shared by every instance, so
    ``copy.deepcopy`` and ``isinstance`` behave as before (FSDP2 swaps classes the same way).
    """
    cls = type(module)
    base = getattr(cls, "_v4_recompute_base", cls)
    attrs = frozenset(getattr(cls, "_v4_recompute_attrs", frozenset()) | {attr})
    key = (base, attrs)
    if key not in _RECOMPUTE_CLASSES:
        namespace = {"_v4_recompute_base": base, "_v4_recompute_attrs": attrs, "__module__": __name__}
        for name in attrs:
            namespace[name] = _checkpointing(base, name, moe=name == "forward" and issubclass(base, MoE))
        _RECOMPUTE_CLASSES[key] = type(f"Recompute{base.__name__}", (base,), namespace)
    return _RECOMPUTE_CLASSES[key]


def _targets(block: nn.Module, name: str) -> Iterator[tuple[nn.Module, str]]:
    """(owning module, method name) of each region ``name`` in ``block``."""
    ffn = block.ffn
    if name == "layernorm":
        yield block.attn_norm, "forward"
        yield block.ffn_norm, "forward"
    elif name == "mla_up_proj":
        yield block.attn, "project_query"
    elif name == "shared_experts" and ffn.shared_experts is not None:
        yield ffn.shared_experts, "forward"
    elif name == "moe_act":
        for expert in ffn.experts.values():
            yield expert, "activation"
        if ffn.shared_experts is not None:
            yield ffn.shared_experts, "activation"
    elif name == "moe":
        yield ffn, "forward"


def apply_recompute(part: nn.Module, modules: list[str], *, max_cp: int = 1, ep: int = 1) -> list[str]:
    """Recompute the regions named by ``modules`` in every decoder block and MTP layer of ``part``.

    Args:
        part: a ``V4Model`` or a pipeline stage cut from one (``pipeline.cut_stage``), before FSDP.
        modules: names from :data:`REGIONS` (``parallel.recompute_modules``; see
            :func:`modules_from_recipe` for the granularity).
        max_cp: the largest CP size of any curriculum stage; ep: ``parallel.ep`` (both for ``moe``).
    Returns:
        The FQNs of the regions under recompute in ``part`` (e.g. ``layers.1.attn.project_query``),
        sorted; empty when ``part`` holds no block or ``modules`` is empty.
    Raises:
        ValueError: a refused or unknown name (:func:`check_recompute_modules`), or
            ``shared_experts`` on a model without shared experts (nothing to recompute).
    Effects: parameters, buffers, FQNs and state-dict keys are unchanged; the forward values are
        unchanged; the regions' activations are freed after the forward and recomputed in backward.
    """
    names = check_recompute_modules(modules, max_cp=max_cp, ep=ep)
    args = getattr(part, "args", None)
    if "shared_experts" in names and args is not None and not args.n_shared_experts:
        raise _refuse(names, "'shared_experts': model.moe.n_shared_experts=0, so there is nothing to recompute",
                      fix="drop 'shared_experts' from parallel.recompute_modules")
    for block in decoder_blocks(part):
        for name in names:
            for owner, attr in _targets(block, name):
                if attr not in getattr(type(owner), "_v4_recompute_attrs", ()):
                    owner.__class__ = _recompute_class(owner, attr)
    return recomputed_regions(part)


def recomputed_regions(part: nn.Module) -> list[str]:
    """FQNs of the regions of ``part`` under recompute, sorted (``layers.0.attn_norm``,
    ``layers.1.attn.project_query``; a module's ``forward`` is named by the module's FQN)."""
    out = []
    for prefix, module in part.named_modules():
        for attr in getattr(type(module), "_v4_recompute_attrs", ()):
            out.append(prefix if attr == "forward" else f"{prefix}.{attr}")
    return sorted(out)
