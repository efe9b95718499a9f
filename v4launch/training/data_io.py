"""The job's view of the data: the prepared dataset of a run and per-stage loaders.

The run's dataset prefix is recorded in run.json["extra"]["data_prefix"] by ``v4launch run``;
a run without one (e.g. created by other tooling) is prepared here by rank 0 into the
workspace cache that holds the run directory. Each stage gets its own loader (its
``seq_len``) over the one global data stream, sharded over the stage's data-parallel replicas
only: the ``cp`` ranks of one CP group read the same micro-batches (``dp_rank / dp`` of the
stage's :class:`~.dist.Layout`) and each keeps its contiguous slice (``shard_thd_batch``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..model.packing import check_ids
from ..validators.eval_cost import EVAL_MICRO_BATCHES
from ..workspace import Workspace
from .dist import DistInfo, Layout


def prepare_for_run(recipe: Any, meta: dict[str, Any], run_dir: Path, info: DistInfo) -> Any:
    """The run's PreparedDataset (rank 0 prepares if needed; every rank then reads it).

    Raises:
        DataError (a V4LaunchError): unreadable inputs or an empty source.
    """
    from ..data.prepare import prepare_dataset, read_dataset
    from ..data.tokenizer import get_tokenizer

    prefix = (meta.get("extra") or {}).get("data_prefix")
    if prefix and Path(f"{prefix}.json").is_file():
        return read_dataset(Path(prefix))
    tokenizer = get_tokenizer(recipe.data.tokenizer)
    ws = Workspace.current(start=run_dir)
    ds = None
    if info.is_main:
        ds = prepare_dataset(recipe.data, tokenizer, workspace=ws)
    if info.active:
        dist.barrier()
    return ds if ds is not None else prepare_dataset(recipe.data, tokenizer, workspace=ws)


def stage_loader(dataset: Any, recipe: Any, plan: Any, layout: Layout, *, valid: bool = False) -> Any:
    """A ``PackedBatchLoader`` for ``plan`` (its seq_len and micro-batch size), sharded over DP replicas.

    All stages read one data stream (seed ``data.seed``): the job hands the previous stage's loader
    state to the next stage's loader, which continues with the first token not yet consumed.
    Training packs as ``data.packing`` says; evaluation (``valid``) always packs whole documents, so the
    held-out loss does not depend on that choice.
    """
    from ..data.blend import BlendDataset, BlendedBatchLoader
    from ..data.packing import PackedBatchLoader

    fill_rows = recipe.data.packing == "fill_rows" and not valid
    if isinstance(dataset, BlendDataset):  # data.source=blend: existing megatron-core datasets sampled by weight
        return BlendedBatchLoader(dataset, seq_len=plan.seq_len, seed=recipe.data.seed, dp_rank=layout.dp_rank,
                                  dp_size=layout.dp, micro_batch_size=plan.micro_batch, shuffle=not valid, valid=valid,
                                  fill_rows=fill_rows)
    prefix = dataset.valid_prefix if valid else dataset.train_prefix
    return PackedBatchLoader(prefix, seq_len=plan.seq_len, seed=recipe.data.seed, dp_rank=layout.dp_rank,
                             dp_size=layout.dp, micro_batch_size=plan.micro_batch, shuffle=not valid,
                             fill_rows=fill_rows)


def to_device(batch: Any, device: torch.device, vocab_size: int) -> Any:
    """``batch`` with its ids range-checked on the host and tokens and labels on ``device``.

    The check (``packing.check_ids``: tokens in [0, ``vocab_size``), labels there or -100) runs on the CPU
    tensors before the copy and marks the batch ``ids_checked``, so the model does not check again on the
    device: that check reads the device back, which makes the host wait for the previous step's queued work
    before it can build this batch's tables (the GPU then idles while the host works).
    ``cu_seqlens`` stays on the CPU: the model reads the boundaries on the host (``packing.make_pack``),
    so a device copy would cost a synchronisation per micro-batch. On a GPU all three are page-locked
    (``pin_memory``, PyTorch's caching host allocator), so the ``non_blocking`` copies of tokens and labels
    here, and the model's own copy of ``cu_seqlens``, are queued behind the GPU's work and the host goes on at
    once; a copy from pageable memory may make the driver wait for the stream (the previous step) first, and
    the GPU then idles while the host builds this step (the H200 product profile of recipes/bench_h200.yaml's
    sparse stage: 155 ms of wall per step against ~133 ms of kernels).

    Raises:
        UsageError: an id out of range (the tensor, the range found, the vocabulary and the fix): the data was
            tokenized for another vocabulary than ``model.vocab_size``.
    """
    try:
        check_ids(batch.tokens, batch.labels, vocab_size)
    except ValueError as exc:
        raise UsageError(f"data: a training batch does not fit model.vocab_size = {vocab_size}: "
                         f"{str(exc).split(' Fix: ')[0]}",
                         hint="set model.vocab_size to the vocabulary the data was tokenized with (at least the "
                              "largest id + 1), or prepare the data again with the recipe's data.tokenizer") from None
    if device.type == "cpu":
        return dataclasses.replace(batch, ids_checked=True)
    return dataclasses.replace(batch, tokens=_pinned(batch.tokens).to(device, non_blocking=True),
                               labels=_pinned(batch.labels).to(device, non_blocking=True),
                               cu_seqlens=_pinned(batch.cu_seqlens), ids_checked=True)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor ``t`` in page-locked memory (itself when it is already there)."""
    return t if t.is_pinned() else t.pin_memory()


def cp_slice(batch: Any, layout: Layout, boundary: int) -> Any:
    """This CP rank's contiguous rows of a packed micro-batch (the batch itself when cp = 1).

    ``tokens`` / ``labels`` become the rank's ``L = T / cp`` rows (labels were shifted globally
    by the loader); ``cu_seqlens``, ``max_seqlen`` and ``num_real_tokens`` stay GLOBAL (the
    model needs the global table; the step counts each token once by dividing by cp).
    """
    if layout.cp == 1:
        return batch
    from ..model.parallel import shard_thd_batch

    local = shard_thd_batch(batch.tokens, batch.labels, batch.cu_seqlens, layout.cp_rank, layout.cp,
                            boundary=boundary)
    return dataclasses.replace(batch, tokens=local.tokens, labels=local.labels)


def newest_epoch(batches: list[Any]) -> int | None:
    """The newest data epoch (0-based) among the rows of this rank's ``batches`` (``PackedBatch.segments``:
    ``(epoch, document, offset, length)``), None when they hold no real token. Rows never mix epochs, so a step
    short of a full step's real tokens under ``data.packing: fill_rows`` holds an epoch's end."""
    return max((seg[0] for mb in batches for seg in (getattr(mb, "segments", None) or ())), default=None)


def micro_batches(it: Iterator[Any], plan: Any, device: torch.device, layout: Layout, boundary: int,
                  vocab_size: int) -> list[Any]:
    """The ``accum`` micro-batches of one step on this rank (its CP slice of each), ids checked (:func:`to_device`)."""
    return [to_device(cp_slice(next(it), layout, boundary), device, vocab_size) for _ in range(plan.accum)]


def eval_batches(dataset: Any, recipe: Any, plan: Any, layout: Layout, device: torch.device, boundary: int,
                 max_batches: int = EVAL_MICRO_BATCHES) -> list[Any]:
    """This rank's share of the first ``max_batches`` held-out micro-batches of one pass (dataset order): the
    same documents at every call, whatever the training data read so far (``validators/eval_cost.py``: the cost).

    The count is global: each rank takes ``ceil(max_batches / dp)`` (the loader deals rows round-robin
    over the dp replicas), so the held-out loss is over the same documents whatever the layout (exactly
    when dp divides ``max_batches``); every rank holds the same count, so collectives match."""
    if dataset.valid_prefix is None:
        return []
    loader = stage_loader(dataset, recipe, plan, layout, valid=True)
    mine = -(-max_batches // layout.dp)
    out = []
    for batch in loader.evaluation_batches():
        if len(out) >= mine:
            break
        out.append(to_device(cp_slice(batch, layout, boundary), device, recipe.model.vocab_size))
    return out
