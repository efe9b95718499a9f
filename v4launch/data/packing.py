"""THD packing: whole documents into fixed-capacity micro-batches, resumable and reshardable.

Every rank runs the same global packer over the same per-epoch shuffled
document order and keeps only its own micro-batches (rank r of dp takes global
micro-batches r, r+dp, …). A row (``seq_len`` tokens) is filled greedily:

* documents are taken whole in shuffled order; one that does not fit in what is
  left of the row starts the next row (``fill_rows=False``, ``data.packing:
  whole_documents``), or fills the rest of the row and continues as a segment of
  its own at the start of the next row (``fill_rows=True``, ``data.packing:
  fill_rows``: no padding except at an epoch's end, at the cost of cutting
  documents at row ends);
* a document longer than ``seq_len`` is cut into ``seq_len``-token pieces, each
  its own segment (its last, shorter piece packs like a short document);
* rows never mix epochs; the last row of an epoch may be short;
* the unfilled tail is one padding segment whose labels are all -100.

Labels: ``labels[t] = tokens[t+1]`` inside a segment, -100 at each segment's last
token (the EOD id appended by ``prepare`` is therefore predicted, never used as a
context for the next document). Documents shorter than a compression ratio are
kept; the model simply makes no compressed entry for them (seed 000 §4).

The state (``state_dict``) is the GLOBAL position: epoch, position in that
epoch's order, token offset into a split document, and micro-batches consumed by
all ranks together. It is the same on every rank, so a resume may use another DP
size, micro-batch size or ``seq_len`` (next curriculum stage) and continues with
the first token not yet consumed: nothing is skipped or repeated (launcher survey
pain points 9 and 14).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .indexed import megatron_indexed

IGNORE_INDEX = -100
"""Label value the loss ignores (padding, segment ends)."""

STATE_VERSION = 1

Cursor = tuple[int, int, int]
"""(epoch, position in the epoch's document order, token offset into that document)."""

Segment = tuple[int, int, int, int]
"""(epoch, document index in the dataset, token offset, length)."""


@dataclass(frozen=True)
class PackedBatch:
    """One THD micro-batch of one rank.

    Attributes:
        tokens: int64 [T], T = micro_batch_size · seq_len (fixed capacity).
        labels: int64 [T]; next token inside a segment, -100 at segment ends and on padding.
        cu_seqlens: int32 [N+1]; segment starts, 0 first and T last; padding tails are segments too.
        max_seqlen: longest segment (tokens), padding included.
        num_docs: real (non-padding) segments: documents or pieces of split documents.
        num_real_tokens: tokens in real segments (T minus padding).
        segments: provenance of each real segment, (epoch, document, offset, length).
        ids_checked: ``tokens`` and ``labels`` were range-checked on the host before their copy to the device
            (``training.data_io.to_device``); the model then skips its own check, which on a GPU reads the
            device back and so waits for all work queued before it (``V4Model.batch_context``).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_docs: int
    num_real_tokens: int
    segments: tuple[Segment, ...] = ()
    ids_checked: bool = False


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")


def _dataset_key(prefix: Path) -> str | None:
    """Cache key of the prepared dataset ``prefix`` belongs to (``P.train`` → ``P.json``'s key), or None."""
    import json

    meta = prefix.with_name(prefix.name.rsplit(".", 1)[0] + ".json") if prefix.suffix in (".train", ".valid") else None
    try:
        return json.loads(meta.read_text()).get("key") if meta is not None else None
    except (OSError, ValueError):
        return None


class PackedBatchLoader:
    """Infinite iterator of this rank's ``PackedBatch`` es from a megatron-core indexed dataset.

    Args:
        prefix: megatron-core path prefix (``PreparedDataset.train_prefix``); each sequence is one document.
        seq_len: tokens per packed row (the stage's ``seq_len``).
        seed: seed of the document order; epoch e uses ``numpy.random.default_rng([seed, e])``.
        dp_rank: this rank's data-parallel index, 0 <= dp_rank < dp_size.
        dp_size: data-parallel size.
        micro_batch_size: rows per micro-batch, concatenated on the token axis (T = rows · seq_len).
        pad_id: token id of padding (its labels are -100 whatever it is).
        shuffle: False keeps dataset order (evaluation).
        fill_rows: cut a document that does not fit the rest of a row at the row's end (its rest starts the
            next row) instead of moving it whole to the next row and padding this one.

    Raises:
        ValueError: seq_len, dp_size or micro_batch_size < 1, dp_rank outside [0, dp_size),
            or a dataset with no tokens; the message names the argument.
        FileNotFoundError: ``prefix``.bin or .idx does not exist.
    """

    def __init__(self, prefix: Path | str, seq_len: int, seed: int, dp_rank: int, dp_size: int,
                 micro_batch_size: int = 1, *, pad_id: int = 0, shuffle: bool = True, fill_rows: bool = False):
        _positive("seq_len", seq_len)
        _positive("dp_size", dp_size)
        _positive("micro_batch_size", micro_batch_size)
        _positive("dp_rank", dp_rank, 0)
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank={dp_rank}: must be < dp_size={dp_size}")
        self.prefix = Path(prefix) if prefix is not None else None
        self.seq_len, self.seed, self.dp_rank, self.dp_size = int(seq_len), int(seed), int(dp_rank), int(dp_size)
        self.micro_batch_size, self.pad_id, self.shuffle = int(micro_batch_size), int(pad_id), shuffle
        self.fill_rows = bool(fill_rows)
        self._open()
        self.num_docs, self.num_tokens = len(self._lengths), int(self._lengths.sum())
        if self.num_tokens == 0:
            raise ValueError(f"prefix={self.prefix}: the dataset holds no tokens")
        self.dataset_key = _dataset_key(self.prefix) if self.prefix is not None else None
        self._orders: dict[int, np.ndarray] = {}
        self._cursor: Cursor = (0, 0, 0)
        self.micro_batches_consumed = 0  # global: all ranks together

    def _open(self) -> None:
        """Open the documents: ``self._ds`` (``get(doc, offset, length)``) and ``self._lengths`` [num_docs]."""
        missing = [f"{self.prefix}.{ext}" for ext in ("bin", "idx") if not Path(f"{self.prefix}.{ext}").is_file()]
        if missing:
            raise FileNotFoundError(f"prefix={self.prefix}: no indexed dataset ({', '.join(missing)} missing); "
                                    "prepare one with `v4launch data prepare`")
        self._ds = megatron_indexed().IndexedDataset(str(self.prefix))
        self._lengths = np.asarray(self._ds.sequence_lengths, dtype=np.int64)

    # ---- global packer (pure in the cursor) ----
    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = self._make_order(epoch)
        return self._orders[epoch]

    def _make_order(self, epoch: int) -> np.ndarray:
        """Document order of ``epoch`` (a shuffle seeded by [seed, epoch], or dataset order)."""
        return (np.random.default_rng([self.seed, epoch]).permutation(self.num_docs)
                if self.shuffle else np.arange(self.num_docs))

    def _pack_row(self, cursor: Cursor) -> tuple[list[Segment], Cursor]:
        """Greedy-fill one row from ``cursor``; return its segments and the cursor after it."""
        epoch, pos, off = cursor
        segs: list[Segment] = []
        used = 0
        while True:
            if pos >= self.num_docs:
                if segs:
                    return segs, (epoch + 1, 0, 0)
                epoch, pos, off = epoch + 1, 0, 0
            doc = int(self._order(epoch)[pos])
            left = int(self._lengths[doc]) - off
            if left <= 0:
                pos, off = pos + 1, 0
                continue
            if left <= self.seq_len - used:
                segs.append((epoch, doc, off, left))
                used += left
                pos, off = pos + 1, 0
                if used == self.seq_len:
                    return segs, self._normal((epoch, pos, off))
                continue
            if used > 0 and self.fill_rows:  # does not fit: its head fills the row, its rest starts the next
                segs.append((epoch, doc, off, self.seq_len - used))
                return segs, (epoch, pos, off + self.seq_len - used)
            if used > 0:  # does not fit: starts the next row
                return segs, (epoch, pos, off)
            segs.append((epoch, doc, off, self.seq_len))  # longer than a row: one full piece
            return segs, (epoch, pos, off + self.seq_len)

    def _normal(self, cursor: Cursor) -> Cursor:
        epoch, pos, off = cursor
        return (epoch + 1, 0, 0) if pos >= self.num_docs else cursor

    def _rows(self, cursor: Cursor, n: int) -> tuple[list[list[Segment]], Cursor]:
        rows = []
        for _ in range(n):
            segs, cursor = self._pack_row(cursor)
            rows.append(segs)
        return rows, cursor

    # ---- materialisation ----
    def _batch(self, rows: list[list[Segment]]) -> PackedBatch:
        T = self.micro_batch_size * self.seq_len
        tokens = np.full(T, self.pad_id, dtype=np.int64)
        labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
        cu, real, t = [0], 0, 0
        for r, segs in enumerate(rows):
            for (_, doc, off, n) in segs:
                tokens[t:t + n] = self._ds.get(doc, offset=off, length=n)
                labels[t:t + n - 1] = tokens[t + 1:t + n]
                t += n
                real += n
                cu.append(t)
            row_end = (r + 1) * self.seq_len
            if t < row_end:  # padding segment: labels stay -100
                t = row_end
                cu.append(t)
        while len(rows) < self.micro_batch_size and t < T:  # all-padding rows (evaluation tail)
            t += self.seq_len
            cu.append(t)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        flat = [s for segs in rows for s in segs]
        return PackedBatch(tokens=torch.from_numpy(tokens), labels=torch.from_numpy(labels), cu_seqlens=cu_t,
                           max_seqlen=int((cu_t[1:] - cu_t[:-1]).max()), num_docs=len(flat),
                           num_real_tokens=real, segments=tuple(flat))

    # ---- iteration ----
    def __iter__(self) -> "PackedBatchLoader":
        return self

    def __next__(self) -> PackedBatch:
        """This rank's next micro-batch; advances the global position by dp_size micro-batches."""
        mbs, mine, cursor = self.micro_batch_size, None, self._cursor
        for r in range(self.dp_size):
            rows, cursor = self._rows(cursor, mbs)
            if r == self.dp_rank:
                mine = rows
        self._cursor = cursor
        self.micro_batches_consumed += self.dp_size
        return self._batch(mine)

    @property
    def epoch(self) -> int:
        """Epoch of the next unconsumed token (global)."""
        return self._cursor[0]

    def evaluation_batches(self) -> Iterator[PackedBatch]:
        """This rank's micro-batches of one pass over the dataset (epoch 0 order); state untouched.

        Every rank yields the same number of batches: a rank left without rows in the
        last round gets an all-padding batch (``num_real_tokens == 0``), so collectives match.
        """
        cursor: Cursor = (0, 0, 0)
        while cursor[0] == 0:
            mine: list[list[Segment]] = []
            for r in range(self.dp_size):
                for _ in range(self.micro_batch_size):
                    if cursor[0] != 0:
                        break
                    segs, cursor = self._pack_row(cursor)
                    if r == self.dp_rank:
                        mine.append(segs)
            yield self._batch(mine)

    # ---- Stateful ----
    def state_dict(self) -> dict[str, Any]:
        """Global position (identical on every rank) plus what it was packed with.

        Keys: version, epoch, position, offset (tokens into a split document),
        micro_batches_consumed (global), seed, num_docs, num_tokens, dataset (the prepared dataset's
        cache key, None when unknown), seq_len, dp_size, micro_batch_size.
        """
        epoch, pos, off = self._cursor
        return {"version": STATE_VERSION, "epoch": epoch, "position": pos, "offset": off,
                "micro_batches_consumed": self.micro_batches_consumed, "seed": self.seed, "dataset": self.dataset_key,
                "num_docs": self.num_docs, "num_tokens": self.num_tokens, "seq_len": self.seq_len,
                "dp_size": self.dp_size, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved global position (any seq_len, dp_size or micro_batch_size).

        Raises:
            ValueError: another dataset (num_docs/num_tokens), another seed or shuffle
                order, a position outside the dataset, or an unknown state version.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"dataloader state version {state.get('version')!r}: expected {STATE_VERSION}")
        for key, mine in (("num_docs", self.num_docs), ("num_tokens", self.num_tokens), ("seed", self.seed)):
            if int(state[key]) != mine:
                raise ValueError(f"dataloader state {key}={state[key]} but this loader has {key}={mine}: "
                                 "resuming would skip or repeat documents (a changed data: section is handled by "
                                 "v4launch.data.resume_state before the state reaches a loader)")
        epoch, pos, off = int(state["epoch"]), int(state["position"]), int(state["offset"])
        if not (0 <= pos <= self.num_docs and off >= 0 and epoch >= 0):
            raise ValueError(f"dataloader state position={pos} offset={off} epoch={epoch} is outside the dataset")
        if pos < self.num_docs and off > int(self._lengths[self._order(epoch)[pos]]):
            raise ValueError(f"dataloader state offset={off} is past the end of its document")
        self._cursor = self._normal((epoch, pos, off))
        self.micro_batches_consumed = int(state["micro_batches_consumed"])
