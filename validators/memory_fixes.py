"""Settings that make an over-budget curriculum stage fit: the fixes V4-MEMORY proposes (pure Python).

A proposal: recipe edits (dotted key → value) and the stage's plan with them; tried in order, alone, smallest first:

1. more context parallelism for the stage (``curriculum.stages.N.cp``): fewer rows per rank;
2. more expert parallelism (``parallel.ep``): fewer routed experts per rank;
3. the distributed optimizer (``parallel.distributed_optimizer=true``): dense state sharded over dp·cp;
4. more pipeline ranks (``parallel.pp`` with a balanced ``parallel.pp_layout``): fewer layers per rank;
5. selective recompute (``parallel.recompute_modules``) of every region without collectives, then
   whole-layer recompute (``parallel.recompute_granularity=full``);
6. precision-aware storage (``BF16_STORAGE``), then with the layer inputs offloaded to host (``OFFLOAD``);
7. all of the above together (whole-layer recompute included; storage and offload only where needed).

A proposal is made only when every stage then fits (each fix printed is a whole one);
``parallel.micro_batch_size=1`` is tried first when the recipe packs several sequences per micro-batch.
When nothing on the recipe's nodes fits, ``memory_fixes_whole.whole_recipe_fit`` proposes one set of edits for
the whole curriculum on more nodes. Every proposal is then checked against every other error rule of the
contract (the ``contract`` argument: ``rules/contract.py`` ``contract_beyond``, V4-MEMORY left out; passed in
so that this module never imports the rules): a fix that fits memory but breaks, say, V4-PP-MICROBATCHES or
V4-CUDA-GRAPH is never proposed (:func:`graph_compatible` turns the graph off where a fix splits the step), while
a failure the recipe already has and the fix leaves as it was (a cudnn stage V4-KERNEL-AVAILABLE refuses) is left
to that rule's own fix.
Sizes are searched over divisors only, so an absurd world size costs no more than a real one."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from math import gcd
from typing import Any

from . import derived
from .cost_model import propose_layout, unit_costs
from .memory_plan import MemoryPlan, PlanUnavailable, memory_plan
from .recompute_policy import SELECTIVE_ALL
from .schema.recipe import Recipe

FULL_RECOMPUTE = {"parallel.recompute_granularity": "full", "parallel.recompute_modules": []}
"""Whole-layer recompute: each layer keeps only its input streams (``recompute_policy``)."""
BF16_STORAGE = {"precision.params_dtype": "bf16", "precision.store_param_remainders": True,
                "precision.exp_avg_dtype": "bf16", "precision.exp_avg_sq_dtype": "bf16"}
"""Precision-aware storage: bf16 weights outside FSDP with their exact fp32 master as 16-bit remainders, bf16
gradients, bf16 optimizer moments (validators/storage_policy.py): 8 B per such parameter instead of 12."""
OFFLOAD = {"parallel.cpu_offloading": True, **FULL_RECOMPUTE}
"""Whole-layer recompute with the layer inputs in pinned host memory between forward and backward."""
STORAGE_STEPS = ({"parallel.cpu_offloading": False}, {**BF16_STORAGE, "parallel.cpu_offloading": False},
                 {**BF16_STORAGE, **OFFLOAD})
"""What a search adds on top of its layout edits, lightest first: the recipe's storage without host offload (offload
costs host memory and copies: a recipe whose host memory is the limit must be able to drop it), bf16 storage, then
bf16 storage with offload."""
Contract = Callable[[Recipe], list[str]]
"""The ids of the error rules a candidate recipe fails, V4-MEMORY left out (``rules/contract.py``)."""


@dataclass(frozen=True)
class Proposal:
    """Recipe edits (dotted key → value) and the stage's plan with them."""

    edits: dict[str, Any]
    plan: MemoryPlan

    def text(self) -> str:
        """``k=v k2=v2 (98.2 GiB)``: the edits and the stage's planned total."""
        return f"{self.edits_text()} ({self.plan.total_bytes / 2**30:.1f} GiB)"

    def edits_text(self) -> str:
        """``k=v k2=v2``, values as a dotlist override takes them, each quoted for a shell where it needs it."""
        return " ".join(shell_word(f"{k}={_yaml(v)}") for k, v in self.edits.items())


def shell_word(text: str) -> str:
    """``text`` as one shell word: unchanged when it is plain, else in single quotes (``'k=Et*3|tmL'``)."""
    return shlex.quote(text)


def _yaml(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(map(str, v)) + "]"
    return str(v)


def with_edits(recipe: Recipe, edits: dict[str, Any]) -> Recipe:
    """A copy of ``recipe`` with ``edits`` applied (keys under parallel., cluster., precision. and
    curriculum.stages.N.). Not validated: the plan only reads sizes."""
    sections: dict[str, dict[str, Any]] = {}
    stages = list(recipe.curriculum.stages)
    for key, value in edits.items():
        head, _, rest = key.partition(".")
        if head == "curriculum":
            _, index, attr = rest.split(".")
            stages[int(index)] = stages[int(index)].model_copy(update={attr: value})
        else:
            sections.setdefault(head, {})[rest] = tuple(value) if isinstance(value, list) else value
    update: dict[str, Any] = {name: getattr(recipe, name).model_copy(update=vals) for name, vals in sections.items()}
    update["curriculum"] = recipe.curriculum.model_copy(update={"stages": tuple(stages)})
    return recipe.model_copy(update=update)


def graph_compatible(recipe: Recipe, edits: dict[str, Any]) -> dict[str, Any]:
    """``edits`` + ``compile.cuda_graph: false`` where they split a captured step over GPUs (V4-CUDA-GRAPH)."""
    splits = edits.get("parallel.distributed_optimizer") or any(
        (k in ("parallel.pp", "parallel.ep") or k.endswith(".cp")) and v > 1 for k, v in edits.items() if type(v) is int)
    return {**edits, "compile.cuda_graph": False} if splits and recipe.compile.cuda_graph else edits


def _plan(recipe: Recipe, index: int, edits: dict[str, Any], contract: Contract) -> MemoryPlan | None:
    """The stage's plan with ``edits`` when every stage then fits and the edited recipe breaks no other error rule."""
    try:
        edited = with_edits(recipe, edits)
        plan = memory_plan(edited, index)
    except (PlanUnavailable, ValueError, ZeroDivisionError):
        return None
    if not plan.fits or contract(edited):
        return None
    for other in range(len(recipe.curriculum.stages)):  # a fix that leaves another stage over budget is no fix
        if other != index and not stage_fits(recipe, other, edits):
            return None
    return plan


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order (O(sqrt n))."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def cp_ok(recipe: Recipe, index: int, cp: int, shard: int) -> bool:
    """Stage ``index`` splits evenly over ``cp`` of ``shard`` ranks, each rank keeping at least the boundary width."""
    st, m = recipe.curriculum.stages[index], recipe.model
    rows = st.seq_len * recipe.parallel.micro_batch_size
    return (shard % cp == 0 and rows % cp == 0 and st.seq_len % cp == 0
            and rows // cp >= derived.boundary_width(m.window_size, m.compress_ratios))


def _single_changes(recipe: Recipe, index: int) -> list[dict[str, Any]]:
    """Candidate edits on the recipe's nodes, smallest step first (the contract is checked by :func:`_plan`)."""
    p, m = recipe.parallel, recipe.model
    world = recipe.cluster.world_size
    shard = world // (p.tp * p.pp)
    st = recipe.curriculum.stages[index]
    cp_now = recipe.stage_cp(st)
    out = []
    for cp in divisors(shard):
        if cp > cp_now and cp_ok(recipe, index, cp, shard):
            out.append({f"curriculum.stages.{index}.cp": cp})
    for ep in divisors(gcd(m.moe.n_routed_experts, shard)):
        if ep > p.ep:
            out.append({"parallel.ep": ep})
    if p.micro_batch_size > 1:  # fewer rows per micro-batch, more micro-batches per step
        out.append({"parallel.micro_batch_size": 1})
    if not p.distributed_optimizer:
        extra = {"precision.keep_fp32_params": False} if p.pp > 1 and recipe.precision.keep_fp32_params else {}
        out.append({"parallel.distributed_optimizer": True, **extra})
    return out + _pp_changes(recipe, index, world)


def _pp_changes(recipe: Recipe, index: int, world: int) -> list[dict[str, Any]]:
    """pp doubled, quadrupled, … with a balanced layout, where the world splits into whole pipeline ranks."""
    p, m = recipe.parallel, recipe.model
    st = recipe.curriculum.stages[index]
    out = []
    pp = p.pp * 2
    while pp <= world and pp * p.vpp <= m.n_layers:
        if world % (p.tp * pp) == 0:
            units = unit_costs(m, st.seq_len, st.phase, recipe.attention.indexer_loss_coeff > 0)
            layout = propose_layout(units, pp * p.vpp, m.moe.n_hash_layers)
            if layout is not None:
                out.append({"parallel.pp": pp, "parallel.pp_layout": layout})
        pp *= 2
    return out


def _combined(recipe: Recipe, index: int) -> dict[str, Any] | None:
    """Whole-layer recompute, the largest cp for the stage, the largest ep and the distributed optimizer
    together, on the recipe's nodes."""
    merged: dict[str, Any] = {} if recipe.parallel.recompute_granularity == "full" else dict(FULL_RECOMPUTE)
    for edits in _single_changes(recipe, index):  # later (larger) cp and ep win
        if "parallel.pp" not in edits:
            merged.update(edits)
    for extra in STORAGE_STEPS:  # storage and offload only where needed
        edits = changed_edits(recipe, {**merged, **extra})
        if edits and stage_fits(recipe, index, edits):
            return edits
    return changed_edits(recipe, {**merged, **BF16_STORAGE, **OFFLOAD}) or None


def fit_proposals(recipe: Recipe, index: int, contract: Contract, limit: int = 3) -> list[Proposal]:
    """Up to ``limit`` edits that make stage ``index`` fit on the recipe's nodes and break no other error
    rule (``contract``; smallest first), else the combination of them when it does; [] when nothing on these
    nodes does (``memory_fixes_whole.whole_recipe_fit`` then searches more nodes and other pipeline sizes)."""
    found: list[Proposal] = []
    seen: set[str] = set()
    for edits in _single_changes(recipe, index) + _recompute_changes(recipe) + _storage_changes(recipe):
        key = " ".join(sorted(k for k in edits if k != "precision.keep_fp32_params"))
        edits = graph_compatible(recipe, edits)
        if key in seen:
            continue
        plan = _plan(recipe, index, edits, contract)
        if plan is not None:
            found.append(Proposal(edits, plan))
            seen.add(key)
        if len(found) >= limit:
            return found
    if found:
        return found
    combined = _combined(recipe, index)
    combined = graph_compatible(recipe, combined) if combined else None
    plan = _plan(recipe, index, combined, contract) if combined else None
    return [Proposal(combined, plan)] if plan is not None else []


def stage_fits(recipe: Recipe, index: int, edits: dict[str, Any]) -> bool:
    """Stage ``index`` of ``recipe`` with ``edits`` has a plan, and it fits."""
    try:
        return memory_plan(with_edits(recipe, edits), index).fits
    except (PlanUnavailable, ValueError, ZeroDivisionError):
        return False


def changed_edits(recipe: Recipe, edits: dict[str, Any]) -> dict[str, Any]:
    """``edits`` without the keys whose value the recipe already has (stage cp: its effective cp)."""
    out = {}
    for key, value in edits.items():
        head, _, rest = key.partition(".")
        if head == "curriculum":
            _, index, attr = rest.split(".")
            st = recipe.curriculum.stages[int(index)]
            now = recipe.stage_cp(st) if attr == "cp" else getattr(st, attr)
        else:
            now = getattr(getattr(recipe, head), rest)
        if (list(now) if isinstance(now, tuple) else now) != value:
            out[key] = value
    return out


def _recompute_changes(recipe: Recipe) -> list[dict[str, Any]]:
    """Selective recompute of every region without collectives, then whole-layer recompute (``full``)."""
    p = recipe.parallel
    if p.recompute_granularity == "full":
        return []
    out = [] if set(SELECTIVE_ALL) <= set(p.recompute_modules) else [
        {"parallel.recompute_granularity": "selective", "parallel.recompute_modules": list(SELECTIVE_ALL)}]
    return out + [FULL_RECOMPUTE]


def _storage_changes(recipe: Recipe) -> list[dict[str, Any]]:
    """``STORAGE_STEPS`` as single changes (what the recipe lacks): host offload off, bf16 storage, bf16 storage with
    whole-layer recompute and host offload."""
    out = [changed_edits(recipe, extra) for extra in STORAGE_STEPS]
    return [e for i, e in enumerate(out) if e and e not in out[:i]]
