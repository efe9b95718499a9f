"""The checkpoint contract: fixed state keys, the JSON manifest, and a small storage protocol.

A checkpoint is the state of six fixed keys (``STATE_KEYS``), each a
``torch.distributed.checkpoint.stateful.Stateful`` or a plain dict, saved with
torch.distributed.checkpoint (``dcp.py``), plus ``manifest.json``: what the run
was when it saved (recipe hash, stage, phase, layer schedule, indexer layers,
optimizer dtype groups, parallel sizes, tokenizer). ``compat.py`` reads the
manifest and the new recipe and decides explicitly whether a resume is safe,
needs a reshard, or is refused; nothing is ever patched silently.

Sources: torchtitan ``components/checkpointer/base.py`` (fixed keys, storage
behind a Protocol), nanochat ``checkpoint_manager.py`` (config next to the
weights), seed 000 §11.3 (resume must check the layer schedule, indexer
existence, mixed-dtype optimizer state and global layer numbering).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from v4launch.validators.schema import Recipe

if TYPE_CHECKING:  # torch is imported where a function needs it: listing checkpoints must not load it
    import torch

STATE_KEYS: tuple[str, ...] = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "curriculum")
"""The only top-level keys a checkpoint holds (style guide "For v4launch" item 9)."""

FORMAT_VERSION = 1
"""Version of the manifest layout; bumped when a field changes meaning."""

MANIFEST_NAME = "manifest.json"
"""File name of the manifest inside a checkpoint directory."""

PARALLEL_KEYS: tuple[str, ...] = ("world", "dp", "cp", "pp", "tp", "ep")
"""Keys of ``Manifest.parallel`` and of ``check_resume(parallel_sizes=...)``."""


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read (incomplete, wrong keys, unreadable manifest).

    Carries ``message`` and ``hint`` like ``v4launch.errors.V4LaunchError``; the
    CLI layer turns it into a user-facing error (this package does not import the CLI).
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


def recipe_fields(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain JSON values: what the user set (computed fields left out).

    This is what :func:`recipe_hash` hashes and what a manifest keeps in ``Manifest.recipe``, so
    the resume report can name every field that changed since a checkpoint.
    """
    return recipe.model_dump(mode="json", exclude_computed_fields=True)


def recipe_hash(recipe: Recipe | Mapping[str, Any]) -> str:
    """sha256 (hex) of the recipe's canonical JSON (:func:`recipe_fields`, sorted keys, no spaces).

    The one recipe identity of a run: run.json's ``recipe_hash``, every manifest's ``recipe_hash``,
    the ``recipe.<hash[:12]>.yaml`` files a re-freeze keeps, and the resume report all use it.
    ``recipe`` may also be the :func:`recipe_fields` dict itself (a manifest's ``recipe``).
    """
    fields = recipe if isinstance(recipe, Mapping) else recipe_fields(recipe)
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def global_layer_ids(n_layers: int, n_mtp_layers: int) -> tuple[int, ...]:
    """Global layer numbering: decoder layers 0..n_layers-1, then MTP layers n_layers.. (one per MTP slot).

    Parameter names carry these ids whatever the pipeline split, so a checkpoint
    saved with PP=4 loads with PP=1 (seed 000 §11.3).
    """
    return tuple(range(n_layers + n_mtp_layers))


def csa_layer_ids(compress_ratios: Iterable[int]) -> tuple[int, ...]:
    """Global ids of the ratio-4 (CSA) layers: the layers that own a lightning indexer."""
    return tuple(i for i, r in enumerate(compress_ratios) if r == 4)


def summarize_param_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> dict[str, dict[str, Any]]:
    """Describe each optimizer group: parameter dtypes and which parameters it holds.

    Args:
        model: the module whose ``named_parameters()`` name the optimizer's tensors.
        optimizer: one optimizer or several (e.g. Muon + AdamW); groups are named by
            ``group["name"]`` when present, else ``group<i>`` (numbered across optimizers).

    Returns:
        ``{group_name: describe_params(...)}``: dtype counts are tensors (not elements);
        unnamed tensors are called ``<unnamed>``.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    import torch

    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    all_groups = [g for opt in optimizers for g in opt.param_groups]
    groups: dict[str, dict[str, Any]] = {}
    for i, group in enumerate(all_groups):
        gname = str(group.get("name", f"group{i}"))
        params = list(group["params"])
        groups[gname] = describe_params([(names.get(id(p), "<unnamed>"), p) for p in params])
    return groups


def describe_params(named: Iterable[tuple[str, torch.Tensor]], *, with_names: bool = True) -> dict[str, Any]:
    """Summary of one optimizer group's (name, tensor) pairs.

    Returns:
        ``{"dtypes": {dtype: count}, "n_params": int, "names_sha256": hex, "params": {name: dtype}}``;
        ``params`` (sorted by name) is left out when ``with_names`` is False, and then
        ``compat`` can only compare the counts and the hash.
    """
    dtypes: dict[str, int] = {}
    params: dict[str, str] = {}
    for name, p in named:
        key = str(p.dtype).removeprefix("torch.")
        dtypes[key] = dtypes.get(key, 0) + 1
        params[name] = key
    digest = hashlib.sha256("\n".join(sorted(params)).encode()).hexdigest()
    out: dict[str, Any] = {"dtypes": dict(sorted(dtypes.items())), "n_params": len(params), "names_sha256": digest}
    if with_names:
        out["params"] = dict(sorted(params.items()))
    return out


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint is, as JSON next to the DCP files (``manifest.json``).

    Fields:
        format_version: manifest layout version (``FORMAT_VERSION``).
        recipe_name: ``Recipe.name``.
        recipe_hash: sha256 of the resolved recipe's canonical JSON (``recipe_hash``).
        stage_index: index of the curriculum stage the step belongs to.
        stage_name: that stage's name.
        phase: attention phase at save: ``dense`` | ``warmup`` | ``sparse``.
        step: optimizer steps completed (global, whole run).
        tokens_consumed: training tokens consumed (global, all ranks, padding excluded).
        compress_ratios: per-layer schedule (decoder layers then MTP slots): 0 SWA, 4 CSA, 128 HCA.
        n_layers: decoder layers.
        n_mtp_layers: MTP layers.
        layer_ids: global layer numbering used in parameter names (``global_layer_ids``).
        indexer_layers: global ids of layers whose lightning indexer is in the checkpoint (empty in dense).
        param_groups: optimizer group name → ``describe_params`` summary.
        parallel: ``{"world", "dp", "cp", "pp", "tp", "ep"}`` sizes at save.
        tokenizer: tokenizer fingerprint (``ByteTokenizer.fingerprint()``).
        model: the recipe's ``model:`` section as JSON (architecture at save).
        torch_version: ``torch.__version__`` of the saving process.
        wall_time: seconds since the Unix epoch when the manifest was written.
        complete: True once every rank's shards and the DCP ``.metadata`` are on disk.
        extra: free-form JSON values the training job wants to keep (never checked).
        recipe: the recipe trained when it saved (:func:`recipe_fields`); empty in manifests written
            before it was recorded (the resume report then looks the recipe up by its hash).
    """

    recipe_name: str
    recipe_hash: str
    stage_index: int
    stage_name: str
    phase: str
    step: int
    tokens_consumed: int
    compress_ratios: tuple[int, ...]
    n_layers: int
    n_mtp_layers: int
    layer_ids: tuple[int, ...]
    indexer_layers: tuple[int, ...]
    param_groups: Mapping[str, Mapping[str, Any]]
    parallel: Mapping[str, int]
    tokenizer: str
    model: Mapping[str, Any] = field(default_factory=dict)
    torch_version: str = field(default_factory=lambda: __import__("torch").__version__)
    wall_time: float = field(default_factory=time.time)
    complete: bool = False
    format_version: int = FORMAT_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)
    recipe: Mapping[str, Any] = field(default_factory=dict)

    @property
    def has_indexer(self) -> bool:
        """True when at least one layer's indexer weights are in the checkpoint."""
        return bool(self.indexer_layers)

    @property
    def model_phase(self) -> str:
        """The phase the model was built in when saved (``extra["model_phase"]``; older saves: the phase, or
        ``dense`` without indexer weights): a resume builds the model so before loading, so that the state it
        asks for is the state saved."""
        return self.extra.get("model_phase") or (self.phase if self.indexer_layers else "dense")

    @classmethod
    def for_recipe(
        cls,
        recipe: Recipe,
        *,
        stage_index: int,
        step: int,
        tokens_consumed: int,
        parallel_sizes: Mapping[str, int],
        tokenizer_fingerprint: str,
        param_groups: Mapping[str, Mapping[str, Any]],
        indexer_layers: Iterable[int] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> "Manifest":
        """Build the manifest of a save made while training ``recipe`` at ``stage_index``.

        ``indexer_layers`` defaults to the CSA layers when the stage's phase is
        warmup or sparse (the indexer exists) and to none in dense.

        Raises:
            IndexError: ``stage_index`` is not a stage of the recipe.
            ValueError: ``parallel_sizes`` lacks one of ``PARALLEL_KEYS`` (extra keys, e.g. ``vpp``, are kept).
        """
        stage = recipe.curriculum.stages[stage_index]
        missing = [k for k in PARALLEL_KEYS if k not in parallel_sizes]
        if missing:
            raise ValueError(f"parallel_sizes lacks {missing}; expected keys {list(PARALLEL_KEYS)}")
        m = recipe.model
        ratios = tuple(int(r) for r in m.compress_ratios)
        if indexer_layers is None:
            indexer_layers = csa_layer_ids(ratios) if stage.phase != "dense" else ()
        return cls(
            recipe_name=recipe.name,
            recipe_hash=recipe_hash(recipe),
            stage_index=stage_index,
            stage_name=stage.name,
            phase=stage.phase,
            step=step,
            tokens_consumed=tokens_consumed,
            compress_ratios=ratios,
            n_layers=m.n_layers,
            n_mtp_layers=m.mtp.depth,
            layer_ids=global_layer_ids(m.n_layers, m.mtp.depth),
            indexer_layers=tuple(sorted(int(i) for i in indexer_layers)),
            param_groups={k: dict(v) for k, v in param_groups.items()},
            parallel={**{k: int(parallel_sizes[k]) for k in PARALLEL_KEYS},
                      **{k: int(v) for k, v in parallel_sizes.items() if k not in PARALLEL_KEYS}},
            tokenizer=tokenizer_fingerprint,
            model=m.model_dump(mode="json"),
            extra=dict(extra or {}),
            recipe=recipe_fields(recipe),
        )

    def replace(self, **changes: Any) -> "Manifest":
        """A copy with ``changes`` applied (e.g. ``complete=True``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def to_json(self) -> str:
        """Indented, key-sorted JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Manifest":
        """Inverse of ``to_dict``.

        Raises:
            CheckpointError: unknown format version, unknown or missing fields.
        """
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"manifest format_version {version!r} is not supported (this v4launch reads {FORMAT_VERSION})",
                hint="resume with the v4launch version that wrote the checkpoint",
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if unknown or missing:
            raise CheckpointError(f"manifest fields do not match format {FORMAT_VERSION}: unknown {unknown}, missing {missing}")
        values = dict(data)
        for name in ("compress_ratios", "layer_ids", "indexer_layers"):
            values[name] = tuple(values[name])
        return cls(**values)

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        """Read ``path`` (a manifest.json or a checkpoint directory holding one).

        Raises:
            CheckpointError: missing or unparsable file, or fields that do not match.
        """
        path = Path(path)
        if path.is_dir():
            path = path / MANIFEST_NAME
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read checkpoint manifest {path}: {e}", hint="pick another checkpoint directory") from e
        return cls.from_dict(data)


class CheckpointStorage(Protocol):
    """Where checkpoints live. ``dcp.DCPStorage`` implements it on a shared filesystem."""

    def save(self, step: int, states: dict[str, Any], manifest: Manifest) -> Path:
        """Write ``states`` + ``manifest`` as step ``step``; return the final checkpoint path."""
        ...

    def load(self, path: Path, states: dict[str, Any]) -> Manifest:
        """Load ``path`` into ``states`` in place; return its manifest."""
        ...

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        ...

    def prune(self, keep_last: int) -> list[Path]:
        """Delete complete checkpoints older than the ``keep_last`` newest; return what was deleted."""
        ...
