"""Resume compatibility: compare a checkpoint's manifest with the run about to load it.

Every aspect gets an explicit verdict (never a silent patch, never a silent fresh
start): ``safe``, ``reshard`` (DCP redistributes the tensors: DP/CP/world/PP/TP/EP
changed), ``applied`` (a changed setting takes effect from the resume step; the reason
says what that means, e.g. that the data order changes), or ``refused`` with the
``--allow-*`` flag that would permit it. A
refused item whose flag the user passed becomes ``safe`` with ``overridden``
set. Architecture changes that alter parameter shapes have no flag: the weights
would not load.

Sources: seed 000 §11.3 (layer schedule, indexer existence, precision-specific
optimizer state, global layer numbering), §12 item 7 (mixed-dtype groups);
launcher survey pain points 9 and 14 (a DP change must never drop or repeat data
silently; the data loader's state is global, so DP changes are a reshard).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from v4launch.validators.schema import PHASE_ORDER, Recipe

from .base import PARALLEL_KEYS, Manifest, csa_layer_ids, global_layer_ids, recipe_fields, recipe_hash

Verdict = Literal["safe", "applied", "warning", "reshard", "refused"]
"""``applied``: a changed recipe field the resumed run uses from the resume step on (see the reason).
``warning``: allowed, but the run loses something it was meant to do (e.g. most of a warm-up stage); the reason
says what."""

WARMUP_SKIP_WARN_FRACTION = 0.25
"""Skipping more than this fraction of a warm-up stage's steps (or all of it) makes the resume's stage item a
``warning``: the indexer trains on less than three quarters of the KL warm-up the recipe planned."""

ALLOW_FLAGS: tuple[str, ...] = (
    "--allow-layer-change",
    "--allow-phase-regression",
    "--allow-optimizer-regroup",
    "--allow-tokenizer-change",
    "--allow-cold-indexer",
)
"""Override flags ``check_resume`` understands (``allow`` takes them with or without dashes)."""

SHAPE_FIELDS: tuple[str, ...] = (
    "vocab_size", "dim", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
    "indexer.n_heads", "indexer.head_dim", "moe.n_routed_experts", "moe.n_shared_experts",
    "moe.moe_inter_dim", "moe.n_hash_layers", "mhc.hc_mult",
)
"""``model:`` fields that set parameter shapes or existence: a change is refused with no override."""

SCHEDULE_FIELDS: tuple[str, ...] = ("n_layers", "compress_ratios", "mtp.depth", "decoder_ratios", "has_csa", "has_hca")
"""``model:`` fields reported by the layer-schedule item rather than as settings (the last three are the schema's
values computed from the first three: listed as settings, they read "shapes unaffected" for a layer added)."""


@dataclass(frozen=True)
class CompatItem:
    """One aspect of a resume and its verdict.

    ``override`` is the flag that permits a refusal (None: nothing can); ``overridden``
    is True when that flag was passed and the verdict turned to ``safe``.
    """

    aspect: str
    verdict: Verdict
    reason: str
    override: str | None = None
    overridden: bool = False

    @property
    def label(self) -> str:
        """``safe``, ``applied``, ``reshard``, ``refused`` or ``safe (overridden)``."""
        return "safe (overridden)" if self.overridden else self.verdict


@dataclass(frozen=True)
class CompatReport:
    """All verdicts of one resume decision; ``ok`` when nothing is refused."""

    items: tuple[CompatItem, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """True when no item is refused (overridden items count as safe)."""
        return not self.refused

    @property
    def refused(self) -> tuple[CompatItem, ...]:
        """The refused items, in report order."""
        return tuple(i for i in self.items if i.verdict == "refused")

    @property
    def needs_reshard(self) -> bool:
        """True when a parallel size changed (DCP redistributes the shards on load)."""
        return any(i.verdict == "reshard" for i in self.items)

    def to_dict(self) -> dict[str, Any]:
        """``{"ok", "needs_reshard", "items": [{aspect, verdict, reason, override, overridden}]}``."""
        return {"ok": self.ok, "needs_reshard": self.needs_reshard, "items": [asdict(i) for i in self.items]}

    def render(self, title: str = "resume compatibility") -> Any:
        """A ``rich.table.Table`` of the items (verdicts coloured)."""
        from rich.table import Table

        from rich.markup import escape

        colour = {"safe": "green", "applied": "cyan", "warning": "bold yellow", "reshard": "yellow", "refused": "bold red"}
        table = Table(title=title, show_lines=False)
        for col in ("aspect", "verdict", "reason", "override"):
            table.add_column(col)
        for i in self.items:
            table.add_row(escape(i.aspect), f"[{colour[i.verdict]}]{i.label}[/]", escape(i.reason), i.override or "")
        return table


def _norm_flag(flag: str) -> str:
    return "--" + flag.lstrip("-").replace("_", "-")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, (list, tuple)) else v
    return out


def _diff(old: Mapping[str, Any], new: Mapping[str, Any], keys: set[str] | None = None) -> list[str]:
    fo, fn = _flatten(old), _flatten(new)
    names = sorted((set(fo) | set(fn)) if keys is None else keys)
    return [f"{k}: {fo.get(k)} → {fn.get(k)}" for k in names if fo.get(k) != fn.get(k) and (k in fo or k in fn)]


_MISSING = "(absent)"


def _leaves(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _leaves(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        for i, v in enumerate(value):  # e.g. curriculum.stages.2.steps
            _leaves(v, f"{path}.{i}", out)
    else:
        out[path] = list(value) if isinstance(value, (list, tuple)) else value


def changed_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every leaf field that differs between two recipe dicts, as ``(dotted path, old, new)``.

    Lists of sections are numbered (``curriculum.stages.2.steps``); a field present on one side only
    shows ``"(absent)"`` on the other. Sorted by path.
    """
    fo, fn = {}, {}
    _leaves(old, "", fo)
    _leaves(new, "", fn)
    return [(k, fo.get(k, _MISSING), fn.get(k, _MISSING)) for k in sorted(set(fo) | set(fn)) if fo.get(k, _MISSING) != fn.get(k, _MISSING)]


def _item(aspect: str, ok: bool, safe_reason: str, bad_reason: str, flag: str | None, allow: set[str]) -> CompatItem:
    if ok:
        return CompatItem(aspect, "safe", safe_reason)
    if flag is not None and flag in allow:
        return CompatItem(aspect, "safe", f"{bad_reason} (allowed by {flag})", flag, overridden=True)
    return CompatItem(aspect, "refused", bad_reason, flag)


def check_resume(
    manifest: Manifest,
    *,
    recipe: Recipe,
    target_stage_index: int,
    target_phase: str,
    parallel_sizes: Mapping[str, int],
    tokenizer_fingerprint: str,
    param_groups: Mapping[str, Mapping[str, Any]],
    allow: set[str] | frozenset[str] = frozenset(),
    checkpoint_recipe: Mapping[str, Any] | None = None,
) -> CompatReport:
    """Decide, aspect by aspect, whether ``manifest``'s checkpoint may be resumed as described.

    Args:
        manifest: the checkpoint's manifest (``Manifest.read(path)``).
        recipe: the resolved recipe the resumed run will train.
        target_stage_index: curriculum stage the resume continues in.
        target_phase: attention phase it will train with (``dense`` | ``warmup`` | ``sparse``).
        parallel_sizes: ``{"world", "dp", "cp", "pp", "tp", "ep"}`` of the resumed run.
        tokenizer_fingerprint: ``ByteTokenizer.fingerprint()`` of the resumed run.
        param_groups: ``base.summarize_param_groups`` of the model/optimizer as built for the resume
            (with the indexer when ``target_phase`` is not dense).
        allow: override flags, e.g. ``{"--allow-layer-change"}`` (dashes/underscores optional).
        checkpoint_recipe: the recipe the checkpoint was saved with (``Manifest.recipe`` or the run's
            ``recipe.<hash>.yaml``), when known: the recipe item then counts the changed fields, which
            the caller lists one by one (``v4launch.training.resume.field_items``).

    Returns:
        CompatReport (items in a fixed order: recipe, architecture, model settings, layer schedule,
        tokenizer, stage, phase, indexer, optimizer groups, then one item per parallel size).

    Raises:
        ValueError: unknown ``target_phase``, stage index out of range, or an unknown flag in ``allow``.
    """
    if target_phase not in PHASE_ORDER:
        raise ValueError(f"target_phase={target_phase!r}: must be one of {list(PHASE_ORDER)}")
    if not 0 <= target_stage_index < len(recipe.curriculum.stages):
        raise ValueError(f"target_stage_index={target_stage_index}: recipe has {len(recipe.curriculum.stages)} stages")
    flags = {_norm_flag(f) for f in allow}
    unknown = sorted(flags - set(ALLOW_FLAGS))
    if unknown:
        raise ValueError(f"allow: unknown override flags {unknown}; known: {list(ALLOW_FLAGS)}")
    m = recipe.model
    items = [_recipe_item(manifest, recipe, checkpoint_recipe)]
    model_now = m.model_dump(mode="json")
    dims = _diff(manifest.model, model_now, set(SHAPE_FIELDS))
    items.append(CompatItem("architecture", "refused", "parameter shapes change: " + "; ".join(dims)) if dims
                 else CompatItem("architecture", "safe", "widths unchanged (each layer's parameter shapes; the "
                                                         "layer schedule is its own item)"))
    others = [d for d in _diff(manifest.model, model_now) if d.split(":")[0] not in SHAPE_FIELDS + SCHEDULE_FIELDS]
    items.append(CompatItem("model settings", "safe", ("changed (shapes unaffected): " + "; ".join(others)) if others else "unchanged"))
    items.append(_schedule_item(manifest, recipe, flags))
    items.append(_item("tokenizer", manifest.tokenizer == tokenizer_fingerprint, f"unchanged ({tokenizer_fingerprint})",
                       f"{manifest.tokenizer} → {tokenizer_fingerprint}: token ids would mean other text", "--allow-tokenizer-change", flags))
    items.extend(_phase_items(manifest, recipe, target_stage_index, target_phase, flags))
    items.append(_optimizer_item(manifest.param_groups, param_groups, manifest.has_indexer, flags))
    items.extend(_parallel_items(manifest.parallel, parallel_sizes))
    return CompatReport(tuple(items))


def _recipe_item(manifest: Manifest, recipe: Recipe, old: Mapping[str, Any] | None) -> CompatItem:
    now = recipe_hash(recipe)
    if now == manifest.recipe_hash:
        return CompatItem("recipe", "safe", f"unchanged ({recipe.name}, {now[:12]})")
    moved = f"{manifest.recipe_hash[:12]} → {now[:12]}"
    if old is None:
        return CompatItem("recipe", "safe", f"differs ({moved}); the checkpoint's recipe is not on record, so its "
                                            "fields cannot be listed: the items below check what matters for loading")
    n = len(changed_fields(old, recipe_fields(recipe)))
    return CompatItem("recipe", "safe", f"differs ({moved}) in {n} field(s), each listed below with its verdict")


def schedule_changes(manifest: Manifest, recipe: Recipe) -> list[str]:
    """How ``recipe``'s layer schedule differs from the checkpoint's (compress ratios, decoder + MTP layer counts,
    global layer numbering), one phrase each; [] when it is the same (then so are the model's tensors)."""
    m = recipe.model
    ratios = tuple(int(r) for r in m.compress_ratios)
    ids = global_layer_ids(m.n_layers, m.mtp.depth)
    changes = []
    if tuple(manifest.compress_ratios) != ratios:
        changes.append(f"compress_ratios {list(manifest.compress_ratios)} → {list(ratios)}")
    if (manifest.n_layers, manifest.n_mtp_layers) != (m.n_layers, m.mtp.depth):
        changes.append(f"layers {manifest.n_layers}+{manifest.n_mtp_layers} MTP → {m.n_layers}+{m.mtp.depth} MTP")
    if tuple(manifest.layer_ids) != ids:
        changes.append(f"global layer numbering {list(manifest.layer_ids)} → {list(ids)}")
    return changes


def _schedule_item(manifest: Manifest, recipe: Recipe, flags: set[str]) -> CompatItem:
    changes = schedule_changes(manifest, recipe)
    ratios = [int(r) for r in recipe.model.compress_ratios]
    return _item("layer schedule", not changes, f"unchanged ({len(ratios)} layers: {ratios})",
                 "; ".join(changes) + ": weights would load into layers of another type", "--allow-layer-change", flags)


def _phase_items(manifest: Manifest, recipe: Recipe, stage_index: int, phase: str, flags: set[str]) -> list[CompatItem]:
    target = recipe.curriculum.stages[stage_index]
    moved = f"{manifest.stage_name} (#{manifest.stage_index}) → {target.name} (#{stage_index})"
    skipped = skipped_steps(manifest, recipe, stage_index)
    warn = [f"skips {n} of {of} steps ({n / of:.0%}) of warm-up stage {name}" + (" (all of it)" if n == of else "")
            for name, phase, n, of, _ in skipped
            if phase == "warmup" and (n == of or n / of > WARMUP_SKIP_WARN_FRACTION)]
    if skipped:  # an explicit --stage / --phase past unfinished stages
        moved += (f"; skips {sum(s[2] for s in skipped)} steps ({sum(s[4] for s in skipped):,} tokens): "
                  + ", ".join(f"the last {n} of {of} steps of {name}" if n < of else f"all {of} steps of {name}"
                              for name, _, n, of, _ in skipped))
    out = [_item("stage", stage_index >= manifest.stage_index, moved,
                 f"stage #{stage_index} ({target.name}) comes before the checkpoint's stage #{manifest.stage_index} "
                 f"({manifest.stage_name})", "--allow-phase-regression", flags)]
    if warn and out[0].verdict == "safe":
        out[0] = CompatItem("stage", "warning", f"{moved}. WARNING: {'; '.join(warn)}, more than "
                                                f"{WARMUP_SKIP_WARN_FRACTION:.0%}: the indexer gets that much less "
                                                "KL warm-up before sparse top-k relies on it")
    src, dst = PHASE_ORDER[manifest.phase], PHASE_ORDER[phase]
    why = {(0, 1): "indexer gets built and initialised", (1, 2): "indexer trained in warm-up",
           (0, 2): "forward move (see indexer)"}.get((src, dst), "unchanged" if src == dst else "")
    out.append(_item("phase", dst >= src, f"{manifest.phase} → {phase}: {why}",
                     f"{manifest.phase} → {phase} moves backwards (phases only move dense → warmup → sparse)",
                     "--allow-phase-regression", flags))
    if manifest.has_indexer or phase == "dense":
        reason = (f"indexer in checkpoint (layers {list(manifest.indexer_layers)})" if manifest.has_indexer
                  else "dense phase: no indexer needed")
        out.append(CompatItem("indexer", "safe", reason))
    else:
        csa = list(csa_layer_ids(recipe.model.compress_ratios))
        out.append(_item("indexer", phase == "warmup", f"no indexer in checkpoint; built fresh for layers {csa} and trained by the warm-up KL",
                         f"no indexer in checkpoint and target phase is {phase}: top-k would come from an untrained "
                         f"indexer (run a warmup stage first)", "--allow-cold-indexer", flags))
    return out


def skipped_steps(manifest: Manifest, recipe: Recipe, stage_index: int) -> list[tuple[str, str, int, int, int]]:
    """What a resume at the start of stage ``stage_index`` skips of the curriculum: one
    ``(stage name, phase, steps skipped, steps of the stage, tokens skipped)`` per stage from the checkpoint's
    (the steps it had left) up to the target (all of each stage between); [] unless the target is after the
    checkpoint's stage with steps left. Tokens are steps × global batch × seq_len of that stage."""
    import math

    stages = recipe.curriculum.stages
    out = []
    for k in range(manifest.stage_index, min(stage_index, len(stages))):
        st = stages[k]
        gbs = recipe.stage_global_batch(st)
        steps = st.steps if st.steps is not None else math.ceil(st.tokens / (gbs * st.seq_len))
        done = int(manifest.extra.get("step_in_stage", 0)) if k == manifest.stage_index else 0
        if steps - done > 0:
            out.append((st.name, st.phase, steps - done, steps, (steps - done) * gbs * st.seq_len))
    return out


def _optimizer_item(old: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]],
                    had_indexer: bool, flags: set[str]) -> CompatItem:
    problems, added_indexer, new_groups = [], 0, []
    for g in sorted(set(old) | set(new)):
        o, n = old.get(g), new.get(g)
        if o is None or n is None:
            if n is not None and not had_indexer and _only_indexer(n):
                added_indexer += int(n.get("n_params", 0))
                new_groups.append(g)
                continue
            problems.append(f"group '{g}' {'added' if o is None else 'removed'}")
            continue
        if "params" in o and "params" in n:
            po, pn = o["params"], n["params"]
            new_names = set(pn) - set(po)
            if not had_indexer and all(".indexer." in f".{k}" for k in new_names):
                added_indexer += len(new_names)
            elif new_names:
                problems.append(f"group '{g}': {len(new_names)} parameters added (e.g. {sorted(new_names)[0]})")
            gone = sorted(set(po) - set(pn))
            if gone:
                problems.append(f"group '{g}': {len(gone)} parameters removed (e.g. {gone[0]})")
            moved = sorted(k for k in set(po) & set(pn) if po[k] != pn[k])
            if moved:
                problems.append(f"group '{g}': dtype of {moved[0]} {po[moved[0]]} → {pn[moved[0]]} ({len(moved)} changed)")
        elif dict(o.get("dtypes", {})) != dict(n.get("dtypes", {})) or o.get("names_sha256") != n.get("names_sha256"):
            problems.append(f"group '{g}': dtypes {dict(o.get('dtypes', {}))} → {dict(n.get('dtypes', {}))}"
                            + ("" if o.get("names_sha256") == n.get("names_sha256") else ", parameter set changed"))
    kept = sorted(g for g in new if g not in new_groups)
    ok_text = f"same groups and dtypes ({', '.join(kept)})"
    if new_groups:
        ok_text = (f"checkpoint's groups unchanged ({', '.join(kept)}); new indexer group"
                   f"{'s' if len(new_groups) > 1 else ''} {', '.join(new_groups)}")
    if added_indexer:
        ok_text += f"; {added_indexer} new indexer parameters start with fresh state"
    return _item("optimizer groups", not problems, ok_text,
                 "; ".join(problems) + ": optimizer state would load into the wrong tensors or precision",
                 "--allow-optimizer-regroup", flags)


def _only_indexer(group: Mapping[str, Any]) -> bool:
    params = group.get("params")
    return bool(params) and all(".indexer." in f".{k}" for k in params)


def _parallel_items(old: Mapping[str, int], new: Mapping[str, int]) -> list[CompatItem]:
    missing = [k for k in PARALLEL_KEYS if k not in new]
    if missing:
        raise ValueError(f"parallel_sizes lacks {missing}; expected keys {list(PARALLEL_KEYS)}")
    keys = [*PARALLEL_KEYS, *sorted((set(old) | set(new)) - set(PARALLEL_KEYS))]  # e.g. vpp: compared when present
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if a == b or (k not in PARALLEL_KEYS and (a or 1) == (b or 1)):  # a size not recorded was 1
            out.append(CompatItem(f"parallel.{k}", "safe", f"unchanged ({b if b is not None else a})"))
        else:
            out.append(CompatItem(f"parallel.{k}", "reshard", f"{a} → {b}: DCP redistributes the saved shards; "
                                  "the data loader continues from its global position"))
    return out
