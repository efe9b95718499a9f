"""Tokenize a recipe's ``data:`` source into megatron-core indexed datasets (.bin/.idx), cached and atomic.

On disk, a prepared dataset is a path prefix ``P`` with::

    P.train.bin / P.train.idx   training documents   (megatron-core IndexedDataset, one sequence per document)
    P.valid.bin / P.valid.idx   held-out documents   (absent when the split holds none)
    P.json                      metadata: cache key, counts, unigram entropy, tokenizer; written last

Each document becomes one sequence: its tokens followed by the end-of-document id.
Empty documents are skipped and counted. Document ``i`` (0-based, among non-empty
documents in source order) is held out when ``floor((i+1)·f) > floor(i·f)`` for
``f = data.validation_fraction``: exactly ``floor(n·f)`` evenly spaced documents,
independent of any seed. Without an explicit prefix the dataset goes to the
workspace cache ``<workspace>/.v4launch/data/<key>/data`` keyed by a hash of the
inputs, so a second run reuses it; the cache entry is built in a temporary
directory and renamed into place. The .bin/.idx files are written with
megatron-core's own ``IndexedDatasetBuilder`` and read back with ``IndexedDataset``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..validators.schema import DataConfig
from ..workspace import STATE_DIR, Workspace
from .blend import BlendDataset, blend_key, prepare_blend
from .indexed import megatron_indexed
from .sources import DataError, documents_for, input_files, interpreter_id
from .tokenizer import ByteTokenizer

FORMAT = 1
"""Version of the prepared layout; part of the cache key."""


@dataclass(frozen=True)
class PreparedDataset:
    """A prepared dataset: where it is and what is in it.

    Attributes:
        prefix: the dataset prefix ``P``.
        train_prefix: ``P.train``: megatron-core path prefix (without .bin/.idx) of the training set.
        valid_prefix: ``P.valid``, or None when no document was held out.
        num_documents: training documents (sequences).
        num_tokens: training tokens, EOD ids included.
        num_valid_documents / num_valid_tokens: the held-out set.
        skipped_empty: empty source documents skipped.
        entropy_bits: unigram entropy of the training tokens, bits/token (EOD counted as a token).
        entropy_nats: the same in nats/token; a language model's loss should fall well below it.
        tokenizer: tokenizer fingerprint the ids belong to.
        key: cache key (sha256 hex) of the inputs.
        reused: True when an existing preparation with the same key was reused.
    """

    prefix: Path
    train_prefix: Path
    valid_prefix: Path | None
    num_documents: int
    num_tokens: int
    num_valid_documents: int
    num_valid_tokens: int
    skipped_empty: int
    entropy_bits: float
    entropy_nats: float
    tokenizer: str
    key: str
    reused: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (paths as strings)."""
        d = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}

    @classmethod
    def read(cls, prefix: Path) -> "PreparedDataset":
        """Open the dataset prepared at ``prefix`` (reads ``P.json``; checks the .bin/.idx files exist).

        Raises:
            DataError: no ``P.json``, unreadable metadata, or missing .bin/.idx files.
        """
        prefix = Path(prefix)
        meta = Path(f"{prefix}.json")
        try:
            data = json.loads(meta.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{meta}: no prepared dataset at prefix {prefix} ({e})",
                            hint=f"prepare it: `v4launch data prepare RECIPE --out {prefix}`") from e
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for k in ("prefix", "train_prefix", "valid_prefix"):
            data[k] = Path(data[k]) if data.get(k) else None
        ds = cls(**data)
        for p in (ds.train_prefix, ds.valid_prefix):
            if p is not None and not (Path(f"{p}.bin").is_file() and Path(f"{p}.idx").is_file()):
                raise DataError(f"{p}.bin/.idx missing for the dataset described by {meta}",
                                hint="prepare it again (delete the prefix's files first)")
        return ds


def cache_key(data_cfg: DataConfig, tokenizer: ByteTokenizer) -> str:
    """sha256 (hex) of everything the prepared files depend on.

    Covers source, absolute paths with each input file's size and mtime (so edited
    inputs are re-prepared), jsonl key, max_documents, validation_fraction, the
    tokenizer fingerprint, and for ``python_stdlib`` the interpreter version and path.

    Raises:
        DataError: a path in ``data.paths`` does not exist.
    """
    if data_cfg.source == "blend":
        return blend_key(data_cfg, tokenizer.fingerprint())
    parts: dict[str, Any] = {
        "format": FORMAT, "source": data_cfg.source, "max_documents": data_cfg.max_documents,
        "validation_fraction": data_cfg.validation_fraction, "tokenizer": tokenizer.fingerprint(),
    }
    if data_cfg.source == "python_stdlib":
        parts["interpreter"] = interpreter_id()
    else:
        parts["jsonl_key"] = data_cfg.jsonl_key
        parts["paths"] = [str(Path(p).expanduser().resolve()) for p in data_cfg.paths]
        parts["files"] = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in input_files(data_cfg.paths)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def default_prefix(workspace: Workspace, key: str) -> Path:
    """``<workspace>/.v4launch/data/<key[:16]>/data``: the cache location of a preparation."""
    return workspace.root / STATE_DIR / "data" / key[:16] / "data"


def _token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def _entropy(counts: np.ndarray) -> tuple[float, float]:
    total = counts.sum()
    if total == 0:
        return 0.0, 0.0
    p = counts[counts > 0] / total
    nats = float(-(p * np.log(p)).sum())
    return nats / math.log(2), nats


def _encode(tokenizer: ByteTokenizer, text: str, dtype: type) -> np.ndarray:
    fast = getattr(tokenizer, "encode_array", None)
    ids = fast(text) if fast is not None else np.asarray(tokenizer.encode(text))
    return np.append(ids.astype(dtype), np.array([tokenizer.eod_id], dtype=dtype))


def _write(data_cfg: DataConfig, tokenizer: ByteTokenizer, prefix: Path, key: str) -> PreparedDataset:
    """Tokenize the source into ``prefix``.{train,valid}.{bin,idx} and ``prefix``.json (written last)."""
    idx = megatron_indexed()
    dtype = _token_dtype(tokenizer.vocab_size)
    builders = {s: idx.IndexedDatasetBuilder(f"{prefix}.{s}.bin", dtype=dtype) for s in ("train", "valid")}
    docs, toks, skipped = {"train": 0, "valid": 0}, {"train": 0, "valid": 0}, 0
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    f, i = data_cfg.validation_fraction, 0
    for text in documents_for(data_cfg.source, data_cfg.paths, data_cfg.jsonl_key):
        if data_cfg.max_documents is not None and i >= data_cfg.max_documents:
            break
        if not text:
            skipped += 1
            continue
        ids = _encode(tokenizer, text, dtype)
        split = "valid" if math.floor((i + 1) * f) > math.floor(i * f) else "train"
        builders[split].add_document(ids, [ids.size])
        docs[split] += 1
        toks[split] += int(ids.size)
        if split == "train":
            counts += np.bincount(ids, minlength=tokenizer.vocab_size)
        i += 1
    for split, b in builders.items():
        b.finalize(f"{prefix}.{split}.idx")
    if docs["train"] == 0:
        raise DataError(f"data.source={data_cfg.source}: no non-empty training document ({skipped} empty skipped, "
                        f"{docs['valid']} held out)", hint="add data or lower data.validation_fraction")
    if docs["valid"] == 0:
        for ext in ("bin", "idx"):
            Path(f"{prefix}.valid.{ext}").unlink()
    bits, nats = _entropy(counts)
    ds = PreparedDataset(
        prefix=prefix, train_prefix=Path(f"{prefix}.train"),
        valid_prefix=Path(f"{prefix}.valid") if docs["valid"] else None,
        num_documents=docs["train"], num_tokens=toks["train"], num_valid_documents=docs["valid"],
        num_valid_tokens=toks["valid"], skipped_empty=skipped, entropy_bits=bits, entropy_nats=nats,
        tokenizer=tokenizer.fingerprint(), key=key,
    )
    meta = Path(f"{prefix}.json.tmp-{os.getpid()}")
    meta.write_text(json.dumps(ds.to_dict(), indent=2, sort_keys=True) + "\n")
    os.replace(meta, f"{prefix}.json")
    return ds


def _rebase(ds: PreparedDataset, prefix: Path) -> PreparedDataset:
    """The same dataset described at ``prefix`` (after its directory was renamed)."""
    return PreparedDataset(**{**ds.__dict__, "prefix": prefix, "train_prefix": Path(f"{prefix}.train"),
                              "valid_prefix": Path(f"{prefix}.valid") if ds.valid_prefix else None})


def _prepare_in_cache(data_cfg: DataConfig, tokenizer: ByteTokenizer, workspace: Workspace, key: str) -> PreparedDataset:
    final = default_prefix(workspace, key)
    tmp_dir = final.parent.parent / f".tmp-{key[:16]}-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        ds = _write(data_cfg, tokenizer, tmp_dir / final.name, key)
        # rewrite the metadata with the final paths, then publish the directory in one rename
        ds = _rebase(ds, final)
        (tmp_dir / f"{final.name}.json").write_text(json.dumps(ds.to_dict(), indent=2, sort_keys=True) + "\n")
        try:
            os.rename(tmp_dir, final.parent)
        except OSError:
            if not Path(f"{final}.json").is_file():  # not a concurrent preparation that won the race
                raise
            return _reused(read_dataset(final))
        return ds
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def prepare_dataset(data_cfg: DataConfig, tokenizer: ByteTokenizer, out_prefix: Path | None = None,
                    workspace: Workspace | None = None) -> PreparedDataset:
    """Prepare (or reuse) the indexed datasets of ``data_cfg``; deterministic for the same inputs.

    Location: ``out_prefix`` if given, else ``data_cfg.prefix`` if set, else the
    workspace cache (``default_prefix``). An existing preparation with the same
    cache key is reused (``reused=True``); files at an explicit prefix that were
    prepared from other inputs are never overwritten.

    Args:
        data_cfg: the recipe's ``data:`` section.
        tokenizer: turns text into ids (``ByteTokenizer``); its fingerprint is stored.
        out_prefix: explicit dataset prefix ``P`` (files ``P.train.bin`` …).
        workspace: workspace whose cache is used (default: ``Workspace.current()``).

    Raises:
        DataError: unreadable inputs (file and line named), no non-empty document, or an
            explicit prefix holding a dataset prepared from other inputs.
    """
    key = cache_key(data_cfg, tokenizer)
    explicit = out_prefix if out_prefix is not None else (Path(data_cfg.prefix) if data_cfg.prefix else None)
    if data_cfg.source == "blend":  # the datasets exist: check them and write the blend's metadata only
        meta = Path(explicit).expanduser().absolute() if explicit else default_prefix(workspace or Workspace.current(), key)
        if (ds := _prepared_here(meta, key)) is not None:
            return _reused(ds)
        return prepare_blend(data_cfg, tokenizer, meta, key)
    if explicit is None:
        workspace = workspace or Workspace.current()
        final = default_prefix(workspace, key)
        if Path(f"{final}.json").is_file():
            return _reused(read_dataset(final))
        return _prepare_in_cache(data_cfg, tokenizer, workspace, key)
    explicit = Path(explicit).expanduser().absolute()
    if (ds := _prepared_here(explicit, key)) is not None:
        return _reused(ds)
    explicit.parent.mkdir(parents=True, exist_ok=True)
    return _prepare_at(data_cfg, tokenizer, explicit, key)


def _prepared_here(prefix: Path, key: str) -> Any:
    """The dataset ``prefix.json`` describes when it was prepared from these inputs (``key``), None when there is none.

    Raises:
        DataError: ``prefix.json`` describes a dataset prepared from other inputs (never overwritten), or
            cannot be read (:func:`read_dataset`).
    """
    if not Path(f"{prefix}.json").is_file():
        return None
    existing = read_dataset(prefix)
    if existing.key == key:
        return existing
    raise DataError(f"{prefix}.json describes a dataset prepared from other inputs (key {existing.key[:12]}, "
                    f"now {key[:12]})", hint="choose another prefix (--out / data.prefix) or delete the old files")


def _prepare_at(data_cfg: DataConfig, tokenizer: ByteTokenizer, prefix: Path, key: str) -> PreparedDataset:
    """Write beside ``prefix`` under a temporary prefix, rename the files into place, then write ``P.json`` last."""
    tmp = Path(f"{prefix}.tmp-{os.getpid()}")
    try:
        ds = _write(data_cfg, tokenizer, tmp, key)
        for split in ("train", "valid") if ds.valid_prefix else ("train",):
            for ext in ("bin", "idx"):
                os.replace(f"{tmp}.{split}.{ext}", f"{prefix}.{split}.{ext}")
        ds = _rebase(ds, prefix)
        meta = Path(f"{tmp}.json")
        meta.write_text(json.dumps(ds.to_dict(), indent=2, sort_keys=True) + "\n")
        os.replace(meta, f"{prefix}.json")
        return ds
    finally:
        for leftover in prefix.parent.glob(f"{tmp.name}*"):
            leftover.unlink(missing_ok=True)


def read_dataset(prefix: Path) -> Any:
    """The dataset described by ``prefix``.json: a ``PreparedDataset``, or a ``blend.BlendDataset``.

    Raises:
        DataError: as ``PreparedDataset.read``; a blend's metadata that does not parse.
    """
    try:
        data = json.loads(Path(f"{prefix}.json").read_text())
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict) and data.get("kind") == "blend":
        try:
            return BlendDataset.from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{prefix}.json: a blend's metadata that does not parse ({exc!r})",
                            hint="delete it and run `v4launch data prepare` again") from None
    return PreparedDataset.read(prefix)


def _reused(ds: Any) -> Any:
    """``ds`` marked as reused (nothing was written)."""
    return type(ds)(**{**ds.__dict__, "reused": True})