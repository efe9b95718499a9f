"""Activation recompute (``parallel.recompute_granularity`` / ``recompute_modules``), applied to a built model from outside.

Which settings are accepted, and what each name means, is decided once, torch-free, in
``validators/recompute_policy.py`` (:func:`recompute_regions`): the recipe validator's rule V4-RECOMPUTE
and this module refuse the same settings with the same text. Spec: seed 000 §10; Megatron's
``recompute_granularity`` / ``recompute_modules`` (reference/megatron-v4-contract.md §A item 17, B3).

What each accepted name recomputes in this model (every decoder block and MTP layer):

==================  ==============================================================  ==========================
name                region (checkpointed in backward)                               collectives replayed
==================  ==============================================================  ==========================
``layernorm``       ``attn_norm`` and ``ffn_norm`` (input and pre-MoE RMSNorm)      none
``mla_up_proj``     ``attn.project_query``: wq_b up-projection, per-head RMS, RoPE  none
``moe_act``         ``Expert.activation`` (clamped SwiGLU) of routed + shared       none
``shared_experts``  ``ffn.shared_experts`` (the whole shared expert)                none
``moe``             ``ffn`` (router, dispatch, experts, combine, balance loss)      balance-loss CP sums at
                                                                                    cp > 1; the expert
                                                                                    all-to-all at ep > 1
``full``            the whole layer (``Block.forward``: mHC, attention, MoE)        the above, and at cp > 1
                    (granularity ``full``)                                          the CP boundary exchange
                                                                                    and compressed all-gathers
==================  ==============================================================  ==========================

A replayed collective is correct: every rank of the group runs the same backward, so it replays the same
collectives in the same order (each is an autograd node, ``parallel/comm.py``); early stopping of the
recompute is switched off for these regions so that no rank stops before a collective another rank runs.
It costs step time, which the validator reports (V4-RECOMPUTE-REPLAY) and seed 000 §10 asks to measure.

How: the module owning a region (the norm, the attention, the expert, the MoE, the block) takes a
subclass of its own class whose region method (``forward``, ``Attention.project_query``,
``Expert.activation``) calls the original through ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` (FSDP2's ``fully_shard`` swaps classes the same way). No module is inserted
or renamed, so parameter FQNs and state-dict keys stay exactly the single-device ones
(``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.``). FSDP2's ``fully_shard`` applied
afterwards per block composes: its hooks run around the block's ``forward`` (and so around a ``full``
checkpoint), the recompute runs inside the block's backward, after FSDP has gathered the block's
parameters. Pipeline stages share their blocks with the model they were cut from
(``pipeline.cut_stage``), so apply this after the split to each part; a region already under recompute
is left as it is (applying twice is harmless).

A replay of the MoE (``moe``, or ``full`` which encloses it) puts back the expert token counts of the
aux-loss-free balancing (``MoE.expert_counts``) it added, so they are counted once per forward. The replay
runs exactly the forward's code (a compiled region replays the same compiled graph, which the checkpoint
needs: it matches the tensors saved by the forward and by the replay one by one).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable, Iterator

from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ...validators.recompute_policy import FULL_LAYER, REGIONS, recompute_regions
from ..attention import BatchContext
from ..common import saved_for_replay
from ..moe import MoE
from .fsdp import decoder_blocks

__all__ = ["COMPILED_REGIONS", "FULL_LAYER", "REGIONS", "apply_recompute", "modules_from_recipe", "recomputed_regions"]


def modules_from_recipe(granularity: str, modules: Iterable[str]) -> list[str]:
    """The region names to recompute (``validators/recompute_policy.recompute_regions``, which see).

    Raises:
        ValueError (``RecomputeRefused``): the setting the validator's V4-RECOMPUTE refuses, with the field,
            the value, the rule and the fix.
    """
    return recompute_regions(granularity, modules)


_RECOMPUTE_CLASSES: dict[tuple[type, frozenset[str]], type] = {}

COMPILED_REGIONS = "_v4_compiled_regions"
"""Instance attribute: {method name: compiled function} that a recomputed region runs instead of the class's
own method (``model/compile.py`` sets it: dynamo does not trace into ``torch.utils.checkpoint``'s replay, so
the region's body is compiled on its own, and both the forward and the replay run the compiled code)."""


def _replayed_moe(module: nn.Module, name: str) -> Callable[[nn.Module], MoE] | None:
    """The MoE whose replay must not count experts again: the module itself (``moe``), its ``ffn``
    (``full``: a block's forward), or None (the region holds no MoE forward)."""
    if name != "forward":
        return None
    if isinstance(module, MoE):
        return lambda owner: owner
    if isinstance(getattr(module, "ffn", None), MoE):
        return lambda owner: owner.ffn
    return None


def _checkpointing(base: type, name: str, moe_of: Callable[[nn.Module], MoE] | None) -> Callable:
    """A method that runs ``base.<name>`` (looked up at each call; the module's compiled copy in
    ``COMPILED_REGIONS`` when there is one) under a non-reentrant checkpoint. A replay sees the batch's
    tables as the forward did (``BatchContext.as_of``, when an argument is the batch context).

    ``moe_of``: the MoE inside the region (None: none); its replay puts the expert counts back as they were,
    so they are counted once. Regions holding a MoE may hold collectives (the balance loss's CP sums,
    the expert all-to-all, and for a whole block the CP exchange): their recompute is not stopped early.
    """

    @functools.wraps(getattr(base, name))
    def run(self, *args, **kwargs):
        method = self.__dict__.get(COMPILED_REGIONS, {}).get(name) or getattr(base, name)
        batch = next((a for a in (*args, *kwargs.values()) if isinstance(a, BatchContext)), None)
        tables = batch.cached_keys() if batch is not None else None
        calls = [0]

        def body(*a, **k):
            calls[0] += 1
            if calls[0] == 1:  # the first pass: what it saves is dropped and recomputed by the replay
                with saved_for_replay(True):
                    return method(self, *a, **k)
            # a replay: the batch's tables as the forward saw them, the experts' tokens counted once
            with saved_for_replay(False), batch.as_of(tables) if batch is not None else contextlib.nullcontext():
                if moe_of is None:
                    return method(self, *a, **k)
                counts = moe_of(self).expert_counts
                before = counts.clone()
                try:
                    return method(self, *a, **k)
                finally:
                    counts.copy_(before)

        if moe_of is None:
            return checkpoint(body, *args, use_reentrant=False, **kwargs)
        with set_checkpoint_early_stop(False):
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
            namespace[name] = _checkpointing(base, name, _replayed_moe(module, name))
        _RECOMPUTE_CLASSES[key] = type(f"Recompute{base.__name__}", (base,), namespace)
    return _RECOMPUTE_CLASSES[key]


def _targets(block: nn.Module, name: str) -> Iterator[tuple[nn.Module, str]]:
    """(owning module, method name) of each region ``name`` in ``block``."""
    ffn = block.ffn
    if name == FULL_LAYER:
        yield block, "forward"
    elif name == "layernorm":
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


def apply_recompute(part: nn.Module, modules: list[str]) -> list[str]:
    """Recompute the regions named by ``modules`` in every decoder block and MTP layer of ``part``.

    Args:
        part: a ``V4Model`` or a pipeline stage cut from one (``pipeline.cut_stage``), before FSDP.
        modules: region names (:func:`modules_from_recipe`): selective names of ``REGIONS``, or
            [``FULL_LAYER``] for whole layers.
    Returns:
        The FQNs of the regions under recompute in ``part`` (e.g. ``layers.1.attn.project_query``; a
        whole layer is named by its FQN, ``layers.1``), sorted; empty when ``part`` holds no block or
        ``modules`` is empty.
    Raises:
        ValueError (``RecomputeRefused``): a refused or unknown name, or ``shared_experts`` on a model
            without shared experts (nothing to recompute).
    Effects: parameters, buffers, FQNs and state-dict keys are unchanged; the forward values are
        unchanged; the regions' activations are freed after the forward and recomputed in backward.
    """
    names = list(modules)
    if names and names != [FULL_LAYER]:  # selective names: the policy's refusals, with this model's shared experts
        names = recompute_regions("selective", names, n_shared_experts=getattr(getattr(part, "args", None),
                                                                                "n_shared_experts", None))
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
