"""The V4 precision policy (``precision.*`` of the recipe) applied to a built model: which GEMM runs FP8.

Spec: seed 000 §9 (precision is per component), seed 004 items 4, 6 and 9; reference/v4-model-spec.md
§1 (parameter dtypes of the released model); reference/megatron-v4-contract.md §D (compressor and
indexer head-weight GEMMs built outside FP8). Rules: V4-PREC-BF16-PINS, V4-PREC-FP32-PINS,
V4-PREC-INDEXER-QK and V4-FP8-SM (validators/rules/precision.py). FP8 itself: torchao's float8
training (``torchao.float8.convert_to_float8_training``), which swaps ``nn.Linear`` modules for
``Float8Linear`` (dynamic scaling, e4m3 forward and backward); ``common.linear`` runs a swapped
module's own forward, so the FP8 GEMM is the one used.

Per GEMM of every decoder block and MTP layer (FQN suffix after ``layers.N.`` / ``mtp.K.``):

=====================================  =========================  =================================================
module                                 precision                  why
=====================================  =========================  =================================================
attn.wq_a, attn.wq_b, attn.wkv,        fp8 (under a recipe)       attention projections (FP8 in the released model)
attn.wo_b
ffn.shared_experts.w1 / w2 / w3        fp8                        shared expert (FP8 in the released model)
e_proj, h_proj (MTP)                   fp8                        MTP projections (FP8 in the released model)
attn.indexer.wq_b                      compute dtype              the selector stays high precision unless
                                                                  precision.policy.indexer_qk opts in (seed 004)
attn.compressor.wkv / wgate,           compute dtype, fp32 out    policy.compressor_gemm (must stay bf16)
attn.indexer.compressor.wkv / wgate
attn.indexer.weights_proj              compute dtype, fp32 out    policy.indexer_weights_proj (must stay bf16)
attn.wo_a                              compute dtype              grouped output projection: an einsum over
                                                                  ``wo_a.weight``, not a Linear call (BF16 in the
                                                                  released model)
ffn.experts.E.w1 / w2 / w3             fp8 (bf16 compute, SM90)   routed experts: grouped GEMMs over the stacked
                                                                  weights (``moe.run_local_experts``); forward and
                                                                  input gradients e4m3 with rowwise scales
                                                                  (``model/fp8_experts.py``) whatever the recipe's
                                                                  dense scaling, weight gradients bf16
ffn.gate (router), head                compute dtype, fp32 out    not nn.Linear calls (router logits and the fused
                                                                  head + loss read the weight)
attn.attn_sink, compressor ape         fp32 parameters            policy.ape / policy.attn_sink (FP32-pinned)
=====================================  =========================  =================================================

"compute dtype" is bf16 under ``precision.dtype: bf16`` (autocast) and fp32 otherwise. The indexer QK
product (``indexer.score_all`` / ``score_at`` and the fused indexer kernel) is an einsum, not a
Linear: an FP8 / FP4 ``policy.indexer_qk`` cannot be honoured and :func:`apply_fp8` refuses it.

Recipe names (``precision.fp8_recipe``) -> torchao recipes: ``delayed`` runs as ``tensorwise``
(one scale per tensor, from the current amax: torchao has no amax history), ``blockwise`` as
``rowwise`` (one power-of-two scale per row of each operand, not DeepSeek's 1x128 / 128x128
blocks); ``mxfp8`` is refused (SM100 and torchao's MX formats; V4-FP8-SM refuses it on Hopper).
:func:`describe_precision` prints the recipe actually run.

Parameters: float32 by default (bf16 compute comes from autocast); ``precision.params_dtype: bf16`` stores the
GEMM weight matrices FSDP does not shard in bf16 (``storage.py``, validators/storage_policy.py) and never the
FP32-pinned ones (``ape``, ``attn_sink``, ``hc_*``, router bias), so ``precision.keep_fp32_params`` true or false
gives the same model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import nn

TORCHAO_RECIPE = {"delayed": "tensorwise", "blockwise": "rowwise"}
"""``precision.fp8_recipe`` -> the torchao float8 recipe that runs it (see the module docstring)."""

_RECIPE_NOTE = {"delayed": "tensorwise: one scale per tensor from the current amax (torchao keeps no amax history)",
                "blockwise": "rowwise: one power-of-two scale per row of each operand, not 1x128 / 128x128 blocks"}

_BLOCK = re.compile(r"^(?:layers|mtp)\.\d+\.")
_ROUTED = re.compile(r"(?:^|\.)ffn\.experts\.\d+\.w[123]$")
_FP8_REASON = {
    "attn.wq_a": "attention projection", "attn.wq_b": "attention projection", "attn.wkv": "attention projection",
    "attn.wo_b": "attention projection", "e_proj": "MTP projection", "h_proj": "MTP projection",
    "ffn.shared_experts.w1": "shared expert", "ffn.shared_experts.w2": "shared expert",
    "ffn.shared_experts.w3": "shared expert",
}
_FIXED_REASON = {
    "attn.wo_a": "grouped output projection: an einsum over wo_a.weight, not a Linear call (BF16 in the released model)",
    "routed": "routed experts: grouped GEMMs over the stacked weights; forward and input gradients e4m3 with "
              "rowwise scales, weight gradients bf16 (model/fp8_experts.py), where apply_fp8 turned it on "
              "(MoE.fp8_experts: bf16 compute on SM90+)",
    "head": "LM head: the fused chunked head + loss reads head.weight (float32 logits)",
    "gate": "router: float32 logits from a low-precision GEMM, not a Linear call",
}


@dataclass(frozen=True)
class Fp8Filter:
    """Per-module FP8 decision under a recipe's precision section (callable as torchao's ``module_filter_fn``).

    Attributes:
        recipe: ``precision.fp8_recipe`` ("none" = nothing runs FP8).
        compute: "bf16" or "fp32" (``precision.dtype``): the precision of every GEMM that is not FP8.
        compressor_gemm, indexer_weights_proj, indexer_qk: ``precision.policy.*``.
    """

    recipe: str
    compute: str
    compressor_gemm: str = "bf16"
    indexer_weights_proj: str = "bf16"
    indexer_qk: str = "bf16"

    def decide(self, fqn: str) -> tuple[str, str]:
        """(precision, reason) of the GEMM whose module has FQN ``fqn`` (a V4Model or pipeline-part FQN)."""
        suffix = _BLOCK.sub("", fqn)
        on = self.recipe != "none"
        if suffix in _FP8_REASON:
            return ("fp8" if on else self.compute), _FP8_REASON[suffix]
        if suffix.endswith("compressor.wkv") or suffix.endswith("compressor.wgate"):
            return self._pinned("compressor_gemm", "compressor GEMM")
        if suffix == "attn.indexer.weights_proj":
            return self._pinned("indexer_weights_proj", "indexer head-weight projection")
        if suffix == "attn.indexer.wq_b":
            fp8 = on and self.indexer_qk == "fp8"
            return ("fp8" if fp8 else self.compute), ("indexer Q projection: the selector stays high precision "
                                                      f"unless precision.policy.indexer_qk opts in (={self.indexer_qk})")
        if re.fullmatch(r"ffn\.experts\.\d+\.w[123]", suffix):
            return self.compute, _FIXED_REASON["routed"]
        for key in ("attn.wo_a", "head", "gate"):
            if suffix == key or suffix == f"ffn.{key}":
                return self.compute, _FIXED_REASON[key]
        return self.compute, "not a GEMM the V4 precision policy names"

    def _pinned(self, field: str, what: str) -> tuple[str, str]:
        value = getattr(self, field)
        on = self.recipe != "none" and value == "fp8"
        return ("fp8" if on else self.compute), f"{what}: precision.policy.{field}={value}"

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        """torchao's ``module_filter_fn``: True when ``module`` (an ``nn.Linear``) at ``fqn`` may run FP8."""
        return isinstance(module, nn.Linear) and self.decide(fqn)[0] == "fp8"


def fp8_module_filter(recipe_precision: Any) -> Fp8Filter:
    """The FP8 module filter of a recipe's ``precision`` section (``validators.schema.PrecisionConfig``).

    Returns: :class:`Fp8Filter`, a ``Callable[[nn.Module, str], bool]`` deciding per module FQN
    whether that ``nn.Linear`` may run FP8 (see the module docstring's table).
    """
    pol = recipe_precision.policy
    return Fp8Filter(recipe=recipe_precision.fp8_recipe, compute=recipe_precision.dtype,
                     compressor_gemm=pol.compressor_gemm, indexer_weights_proj=pol.indexer_weights_proj,
                     indexer_qk=pol.indexer_qk)


def precision_table(model: nn.Module, filter: Fp8Filter) -> list[tuple[str, str]]:
    """(FQN, precision) of every GEMM weight holder and FP32-pinned parameter of ``model``, in module order.

    GEMMs: every ``nn.Linear`` (FP8-converted ones included) and the routers (``ffn.gate``);
    precision "fp8", "bf16" or "fp32" (:meth:`Fp8Filter.decide`; routed experts "fp8" where their MoE's
    ``fp8_experts`` is on: they are not converted modules, the grouped GEMM reads their weights). Parameters: ``attn_sink`` and
    ``ape`` (``precision.policy.attn_sink`` / ``ape``), which the model keeps float32.
    """
    rows = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) or fqn.endswith("ffn.gate"):
            rows.append((fqn, _converted(module) or _routed_fp8(model, fqn) or filter.decide(fqn)[0]))
        for leaf in ("attn_sink", "ape"):
            if isinstance(getattr(module, leaf, None), torch.Tensor) and leaf in module._parameters:
                rows.append((f"{fqn}.{leaf}", str(getattr(module, leaf).dtype).removeprefix("torch.").replace(
                    "float", "fp")))
    return rows


def _routed_fp8(model: nn.Module, fqn: str) -> Optional[str]:
    """"fp8" for a routed expert's w1 / w2 / w3 whose MoE runs its grouped GEMMs in FP8 (``MoE.fp8_experts``),
    else None."""
    if not _ROUTED.search(fqn):
        return None
    return "fp8" if getattr(model.get_submodule(fqn.split(".experts.")[0]), "fp8_experts", False) else None


def _converted(module: nn.Module) -> Optional[str]:
    """"fp8" for a module torchao converted (its class brings its own GEMM), else None."""
    return "fp8" if isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward else None


def describe_precision(model: nn.Module, filter: Fp8Filter) -> str:
    """The job-start report: one line per FQN pattern (layer and expert ids as ``*``) with count, precision, reason."""
    groups: dict[tuple[str, str], int] = {}
    for fqn, prec in precision_table(model, filter):
        pattern = re.sub(r"\.\d+\.", ".*.", f".{fqn}.").strip(".")
        groups[(pattern, prec)] = groups.get((pattern, prec), 0) + 1
    run = "none (no GEMM in FP8)" if filter.recipe == "none" else (
        f"{filter.recipe} -> torchao {_RECIPE_NOTE.get(filter.recipe, filter.recipe)}")
    lines = [f"precision: compute {filter.compute}, fp8_recipe {run}; parameters stored fp32"]
    width = max((len(p) for p, _ in groups), default=10)
    for (pattern, prec), n in groups.items():
        reason = ("FP32-pinned parameter (precision.policy)" if pattern.endswith(("attn_sink", "ape"))
                  else filter.decide(pattern.replace("*", "0"))[1])
        lines.append(f"  {pattern:<{width}}  {prec:<4} x{n:<4} {reason}")
    return "\n".join(lines)


def check_precision_policy(recipe_precision: Any) -> None:
    """Refuse a ``precision.policy`` this model cannot honour (any fp8_recipe, none included).

    Raises:
        ValueError (field, value, rule, fix): compressor_gemm or indexer_weights_proj not bf16
            (V4-PREC-BF16-PINS); ape or attn_sink not fp32 (V4-PREC-FP32-PINS: the model keeps them
            float32); indexer_qk not bf16 (the QK product is an einsum that FP8 / FP4 does not
            reach in this build).
    """
    pol = recipe_precision.policy
    for field in ("compressor_gemm", "indexer_weights_proj"):
        if getattr(pol, field) != "bf16":
            raise ValueError(f"precision.policy.{field}={getattr(pol, field)}: V4-PREC-BF16-PINS: it must stay bf16 "
                             f"under FP8. Fix: set precision.policy.{field}=bf16.")
    for field in ("ape", "attn_sink"):
        if getattr(pol, field) != "fp32":
            raise ValueError(f"precision.policy.{field}={getattr(pol, field)}: V4-PREC-FP32-PINS: it feeds a softmax "
                             f"and the model keeps it float32. Fix: set precision.policy.{field}=fp32.")
    if pol.indexer_qk != "bf16":
        raise ValueError(f"precision.policy.indexer_qk={pol.indexer_qk}: the indexer QK product is an einsum "
                         "(model/indexer.py score_all / score_at, the fused indexer kernel), not a Linear, so "
                         f"{pol.indexer_qk} cannot reach it in this build and it would silently stay high precision. "
                         "Fix: set precision.policy.indexer_qk=bf16.")


def torchao_config(fp8_recipe: str, *, emulate: bool = False) -> Any:
    """The ``torchao.float8.Float8LinearConfig`` that runs ``precision.fp8_recipe`` (:data:`TORCHAO_RECIPE`).

    Raises:
        ValueError: "mxfp8" (or any name outside :data:`TORCHAO_RECIPE`), or torchao not installed.
    """
    if fp8_recipe not in TORCHAO_RECIPE:
        raise ValueError(f"precision.fp8_recipe={fp8_recipe}: V4-FP8-SM: this build runs FP8 through torchao's float8 "
                         f"training, which has no {fp8_recipe} recipe here (MXFP8 needs SM100+). Fix: set "
                         "precision.fp8_recipe=blockwise (runs as rowwise scaling) or delayed (runs as tensorwise), "
                         "or none.")
    try:
        from torchao.float8 import Float8LinearConfig  # noqa: PLC0415  (optional dependency: pip install '.[fp8]')
    except ImportError as exc:
        raise ValueError(f"precision.fp8_recipe={fp8_recipe}: FP8 training needs torchao, which does not import here "
                         f"({exc}). Fix: pip install 'v4launch[fp8]' (torchao), or set precision.fp8_recipe=none.") from None
    return replace(Float8LinearConfig.from_recipe_name(TORCHAO_RECIPE[fp8_recipe]), emulate=emulate)


def _fp8_device_problem(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"the model is on {device.type}, which has no FP8 tensor cores"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"the GPU is SM{major}{minor}; FP8 GEMMs need SM89+"
    return None


def apply_fp8(model: nn.Module, recipe_precision: Any, *, emulate: bool = False) -> list[str]:
    """Convert the ``nn.Linear`` modules the V4 policy allows to torchao ``Float8Linear`` (in place).

    Args:
        model: a ``V4Model`` or pipeline part, before FSDP, on its training device.
        recipe_precision: the recipe's ``precision`` section.
        emulate: torchao's emulation (FP8 rounding with high-precision GEMMs), for CPU tests only;
            without it a device lacking FP8 tensor cores is refused.
    Returns: the FQNs of the modules that run FP8, in module order ([] when fp8_recipe is "none"): the converted
        ``Float8Linear`` modules and, with bf16 compute on an SM90+ GPU, every routed expert's w1 / w2 / w3,
        whose MoE then runs its grouped GEMMs in FP8 (``MoE.fp8_experts``, ``fp8_experts.fp8_expert_mlp``) and, with
        ``precision.fp8_dispatch`` (``MoE.fp8_dispatch``) under expert parallelism, exchanges the rows into its
        experts as e4m3 (``ExpertParallelDispatch.fp8_experts``).
    Raises:
        ValueError (field, value, rule, fix): :func:`check_precision_policy`; an unknown recipe or no
        torchao (:func:`torchao_config`); a device without FP8 GEMMs (V4-FP8-SM); an FP8 module whose
        in/out features are not multiples of 16 (the FP8 GEMM's alignment); on an SM90+ GPU with bf16 compute,
        routed experts whose widths are not multiples of 16.
    Effects: FQNs, parameters (the same ``Parameter`` objects) and state-dict keys are unchanged.
        Indexers built later by ``set_phase`` stay in the compute dtype (the policy keeps them there).
    """
    check_precision_policy(recipe_precision)
    filt = fp8_module_filter(recipe_precision)
    if filt.recipe == "none":
        return []
    config = torchao_config(filt.recipe, emulate=emulate)
    param = next(model.parameters(), None)
    problem = None if emulate or param is None else _fp8_device_problem(param.device)
    if problem:
        raise ValueError(f"precision.fp8_recipe={filt.recipe}: V4-FP8-SM: {problem}. Fix: run on an SM89+ GPU "
                         "(H100, H200), or set precision.fp8_recipe=none.")
    chosen = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and filt(m, fqn)]
    for fqn, m in chosen:
        if m.in_features % 16 or m.out_features % 16:
            raise ValueError(f"precision.fp8_recipe={filt.recipe}: {fqn} is a {m.in_features} -> {m.out_features} "
                             "GEMM, and FP8 GEMMs need in and out features that are multiples of 16. Fix: choose "
                             "model dimensions (dim, q_lora_rank, n_heads*head_dim, o_groups*o_lora_rank, "
                             "moe_inter_dim) that are multiples of 16, or set precision.fp8_recipe=none.")
    from torchao.float8 import convert_to_float8_training  # noqa: PLC0415  (imported by torchao_config above)

    moes = _fp8_expert_layers(model, filt, None if emulate or param is None else param.device)
    names = {fqn for fqn, _ in chosen}
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in names, config=config)
    for moe in moes:
        moe.fp8_experts = True
        moe.fp8_dispatch = bool(recipe_precision.fp8_dispatch)
    return [fqn for fqn, m in model.named_modules() if _converted(m) or _routed_fp8(model, fqn)]


def _fp8_expert_layers(model: nn.Module, filt: Fp8Filter, device: Optional[torch.device]) -> list[nn.Module]:
    """The MoE layers whose routed experts run the FP8 grouped GEMMs (``fp8_experts.fp8_expert_mlp``): every layer with
    routed experts when the compute dtype is bf16 on an SM90+ GPU (``torch._scaled_grouped_mm``), else none
    (an SM89 GPU, fp32 compute, or ``device`` None: emulation on the CPU, where the grouped path does not run).

    Raises:
        ValueError (field, value, fix): an expert width (dim, moe_inter_dim) that is not a multiple of 16.
    """
    moes = [m for m in model.modules() if hasattr(m, "fp8_experts") and len(getattr(m, "experts", ()))]
    if (device is None or filt.compute != "bf16" or not moes
            or torch.cuda.get_device_capability(device) < (9, 0)):
        return []
    w1 = next(iter(moes[0].experts.values())).w1
    if w1.in_features % 16 or w1.out_features % 16:
        raise ValueError(f"precision.fp8_recipe={filt.recipe}: the routed experts are {w1.in_features} -> "
                         f"{w1.out_features} GEMMs, and the FP8 grouped GEMM needs multiples of 16. Fix: choose dim "
                         "and moe.moe_inter_dim multiples of 16, or set precision.fp8_recipe=none.")
    return moes
