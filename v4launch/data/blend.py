"""Data blends: existing megatron-core indexed datasets (.bin/.idx prefixes) mixed by weight.

``data: {source: blend, blend: [{weight: 0.7, prefix: /data/web_text_document}, {weight: 0.3, prefix: …}]}``
is Megatron-LM's ``--data-path 0.7 /data/web_text_document 0.3 …``. Preparing a blend reads every
prefix once (``check_prefix``): the token ids must lie below the tokenizer's vocabulary (which
rule V4-VOCAB checks against ``model.vocab_size``), and a tokenizer recorded beside the prefix
(``<prefix>.json``, as ``v4launch data prepare`` writes it) must be the recipe's. The metadata goes
to the workspace cache like any prepared dataset; the .bin/.idx files are read where they are.

Held out: document d of a prefix is held out when ``floor((d+1)·f) > floor(d·f)`` for
``f = data.validation_fraction`` (the rule ``prepare`` uses), in every prefix.

Sampling (:class:`BlendedBatchLoader`): one blend epoch is a sequence of D = Σ n_s document draws
(n_s: training documents of prefix s). Prefix s gets c_s ≈ w_s · D draws (largest remainders); its
j-th draw of the epoch sits at ideal time (j + ½) / c_s and the draws of all prefixes are
merged by that time (ties by prefix order), so every stretch of the stream follows the weights.
A prefix's draws walk its documents in a shuffled order, a new one each time it wraps
(``default_rng([seed, s, wrap])``), continuing across blend epochs: an up-weighted prefix repeats,
a down-weighted one is spread over several epochs. The packer, state and resume rules are those
of :class:`~.packing.PackedBatchLoader` over this stream, so a resume at any DP size, micro-batch
size or seq_len continues at the first token not yet consumed. Source: Megatron-LM
``BlendedDataset`` (weights normalised, per-dataset sample counts) for the idea, not its code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .packing import PackedBatchLoader
from .indexed import megatron_indexed
from .sources import DataError

SCAN_CHUNK = 1 << 24
"""Tokens read per step while a prefix is scanned (32 MiB of uint16)."""


@dataclass(frozen=True)
class BlendDataset:
    """A prepared blend: the prefixes, their weights and what the checks found.

    Attributes mirror ``PreparedDataset`` where the job reads them (num_documents and num_tokens of
    the training documents of all prefixes, entropy of the weighted mixture, tokenizer fingerprint,
    cache key); ``sources`` holds per prefix: prefix, weight (normalised), documents, tokens,
    max_id, train/valid documents, tokenizer (recorded beside it, or None).
    """

    prefix: Path
    sources: tuple[dict[str, Any], ...]
    num_documents: int
    num_tokens: int
    num_valid_documents: int
    num_valid_tokens: int
    entropy_bits: float
    entropy_nats: float
    tokenizer: str
    key: str
    validation_fraction: float
    reused: bool = False
    skipped_empty: int = 0

    @property
    def train_prefix(self) -> Path:
        """The blend's metadata prefix (the loader reads the sources it names)."""
        return self.prefix

    @property
    def valid_prefix(self) -> Path | None:
        """None when no document is held out (then the job skips evaluation)."""
        return self.prefix if self.num_valid_documents else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``kind: blend`` tells it from a prepared dataset)."""
        return {"kind": "blend", **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BlendDataset":
        """Inverse of :meth:`to_dict`."""
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        values["prefix"], values["sources"] = Path(values["prefix"]), tuple(values["sources"])
        return cls(**values)


def held_out(n: int, fraction: float) -> np.ndarray:
    """Boolean [n]: document d is held out when floor((d+1)·f) > floor(d·f)."""
    d = np.arange(n, dtype=np.float64)
    return np.floor((d + 1) * fraction) > np.floor(d * fraction)


def check_prefix(prefix: str, vocab_size: int, fingerprint: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Read one megatron-core prefix: (summary, unigram counts [vocab_size], document lengths [n]).

    Raises:
        DataError: missing .bin/.idx, a .bin whose size does not match its index, a token id
            >= ``vocab_size`` (the id and its position named), or a recorded tokenizer that differs.
    """
    missing = [f"{prefix}.{e}" for e in ("bin", "idx") if not Path(f"{prefix}.{e}").is_file()]
    if missing:
        raise DataError(f"data.blend prefix {prefix}: {', '.join(missing)} missing",
                        hint="give the path prefix of a megatron-core dataset (the files without .bin/.idx)")
    recorded = _recorded_tokenizer(prefix)
    if recorded is not None and recorded != fingerprint:
        raise DataError(f"data.blend prefix {prefix} was tokenized with {recorded}, the recipe's data.tokenizer is "
                        f"{fingerprint}", hint="blend only data made with the recipe's tokenizer (or set data.tokenizer)")
    ds = megatron_indexed().IndexedDataset(str(prefix))
    lengths = np.array(ds.sequence_lengths, dtype=np.int64)  # a copy: the index's view dies with ``ds``
    tokens = np.memmap(f"{prefix}.bin", dtype=ds.index.dtype, mode="r")
    if tokens.size != int(lengths.sum()):
        raise DataError(f"{prefix}.bin holds {tokens.size} tokens, its .idx describes {int(lengths.sum())}",
                        hint="the .bin/.idx pair is damaged or mismatched: build it again")
    counts = np.zeros(vocab_size, dtype=np.int64)
    top = -1
    for start in range(0, tokens.size, SCAN_CHUNK):
        chunk = np.asarray(tokens[start:start + SCAN_CHUNK]).astype(np.int64)
        if chunk.size and (int(chunk.max()) >= vocab_size or int(chunk.min()) < 0):
            bad = int(np.flatnonzero((chunk >= vocab_size) | (chunk < 0))[0])
            raise DataError(f"data.blend prefix {prefix}: token id {int(chunk[bad])} at position {start + bad} is "
                            f"outside the tokenizer's vocabulary 0..{vocab_size - 1}",
                            hint="the prefix was made with another tokenizer: set data.tokenizer to that tokenizer")
        counts += np.bincount(chunk, minlength=vocab_size)
        top = max(top, int(chunk.max()) if chunk.size else -1)
    return {"prefix": str(prefix), "documents": int(lengths.size), "tokens": int(lengths.sum()), "max_id": top,
            "tokenizer": recorded}, counts, lengths


def _recorded_tokenizer(prefix: str) -> str | None:
    """Tokenizer fingerprint recorded beside a prefix: ``P.json`` of ``P.train`` / ``P.valid`` or of ``P``."""
    p = Path(prefix)
    for meta in (p.with_name(p.name.rsplit(".", 1)[0] + ".json"), Path(f"{p}.json")):
        try:
            value = json.loads(meta.read_text()).get("tokenizer")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            return value
    return None


def blend_key(data_cfg: Any, fingerprint: str) -> str:
    """sha256 of the blend's inputs: prefixes (absolute) with their files' sizes and mtimes, weights,
    validation_fraction, tokenizer fingerprint."""
    parts = {"kind": "blend", "fraction": data_cfg.validation_fraction, "tokenizer": fingerprint, "sources": []}
    for item in data_cfg.blend:
        p = str(Path(item.prefix).expanduser().absolute())
        stats = [(Path(f"{p}.{e}").stat().st_size, Path(f"{p}.{e}").stat().st_mtime_ns)
                 if Path(f"{p}.{e}").exists() else None for e in ("bin", "idx")]
        parts["sources"].append([item.weight, p, stats])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def prepare_blend(data_cfg: Any, tokenizer: Any, meta_prefix: Path, key: str) -> BlendDataset:
    """Check every prefix of ``data_cfg.blend`` and write the blend's metadata ``meta_prefix``.json (atomic).

    Raises:
        DataError: as :func:`check_prefix`, or a prefix with no training document.
    """
    total_w = sum(item.weight for item in data_cfg.blend)
    sources, mixture = [], np.zeros(tokenizer.vocab_size, dtype=np.float64)
    n_train = t_train = n_valid = t_valid = 0
    for item in data_cfg.blend:
        prefix = str(Path(item.prefix).expanduser().absolute())
        summary, counts, lengths = check_prefix(prefix, tokenizer.vocab_size, tokenizer.fingerprint())
        valid = held_out(lengths.size, data_cfg.validation_fraction)
        if (~valid).sum() == 0:
            raise DataError(f"data.blend prefix {prefix}: no training document ({lengths.size} documents, all held out)",
                            hint="lower data.validation_fraction or drop the prefix")
        summary.update(weight=item.weight / total_w, train_documents=int((~valid).sum()),
                       valid_documents=int(valid.sum()))
        sources.append(summary)
        n_train, t_train = n_train + int((~valid).sum()), t_train + int(lengths[~valid].sum())
        n_valid, t_valid = n_valid + int(valid.sum()), t_valid + int(lengths[valid].sum())
        if counts.sum():
            mixture += summary["weight"] * counts / counts.sum()
    p = mixture[mixture > 0]
    nats = float(-(p * np.log(p)).sum())
    ds = BlendDataset(prefix=meta_prefix, sources=tuple(sources), num_documents=n_train, num_tokens=t_train,
                      num_valid_documents=n_valid, num_valid_tokens=t_valid, entropy_bits=nats / math.log(2),
                      entropy_nats=nats, tokenizer=tokenizer.fingerprint(), key=key,
                      validation_fraction=data_cfg.validation_fraction)
    meta_prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{meta_prefix}.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(ds.to_dict(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, f"{meta_prefix}.json")
    return ds


class _BlendDocuments:
    """The training (or held-out) documents of every prefix as one id space: virtual id -> (prefix, document)."""

    def __init__(self, dataset: BlendDataset, valid: bool):
        idx = megatron_indexed()
        self.sets, self.doc_ids, lengths = [], [], []
        for src in dataset.sources:
            ds = idx.IndexedDataset(src["prefix"])
            keep = held_out(len(ds), dataset.validation_fraction)
            ids = np.flatnonzero(keep if valid else ~keep)
            self.sets.append(ds)
            self.doc_ids.append(ids)
            lengths.append(np.array(ds.sequence_lengths, dtype=np.int64)[ids])
        self.counts = np.array([ids.size for ids in self.doc_ids], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.lengths = np.concatenate(lengths)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of virtual document ``doc`` (the megatron-core ``IndexedDataset.get`` signature)."""
        s = int(np.searchsorted(self.offsets, doc, side="right") - 1)
        return self.sets[s].get(int(self.doc_ids[s][doc - self.offsets[s]]), offset=offset, length=length)


def draws_per_epoch(weights: np.ndarray, total: int) -> np.ndarray:
    """c_s: ``total`` draws split by ``weights`` (floor, then the largest remainders; ties to the first prefix)."""
    exact = weights / weights.sum() * total
    counts = np.floor(exact).astype(np.int64)
    order = sorted(range(len(weights)), key=lambda s: (-(exact[s] - counts[s]), s))
    counts[order[: total - int(counts.sum())]] += 1
    return counts


class BlendedBatchLoader(PackedBatchLoader):
    """``PackedBatchLoader`` over a weighted blend (sampling rule in the module docstring).

    Args: dataset (a :class:`BlendDataset`), then as ``PackedBatchLoader`` (``fill_rows`` included);
    ``valid=True`` reads the held-out documents (in prefix order: ``shuffle`` False).
    """

    def __init__(self, dataset: BlendDataset, seq_len: int, seed: int, dp_rank: int, dp_size: int,
                 micro_batch_size: int = 1, *, pad_id: int = 0, shuffle: bool = True, valid: bool = False,
                 fill_rows: bool = False):
        self._docs = _BlendDocuments(dataset, valid)
        self._weights = np.array([s["weight"] for s in dataset.sources], dtype=np.float64)
        super().__init__(None, seq_len, seed, dp_rank, dp_size, micro_batch_size, pad_id=pad_id, shuffle=shuffle,
                         fill_rows=fill_rows)
        self.dataset_key = dataset.key

    def _open(self) -> None:
        self._ds, self._lengths = self._docs, self._docs.lengths

    def _make_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_docs)
        per_epoch = draws_per_epoch(self._weights, self.num_docs)
        draws, times = [], []
        for s, (c, n) in enumerate(zip(per_epoch, self._docs.counts)):
            k = epoch * int(c) + np.arange(int(c))  # this prefix's draws so far, over all epochs
            local = np.empty(int(c), dtype=np.int64)
            for wrap in np.unique(k // n):
                sel = k // n == wrap
                local[sel] = np.random.default_rng([self.seed, s, int(wrap)]).permutation(int(n))[k[sel] % n]
            draws.append(self._docs.offsets[s] + local)
            times.append((np.arange(int(c)) + 0.5) / max(int(c), 1))
        merged = np.argsort(np.concatenate(times), kind="stable")  # stable: ties keep prefix order
        return np.concatenate(draws)[merged]
