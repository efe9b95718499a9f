"""Job-facing CP API without processes: slicing, errors, MTP shift convention, module boundaries."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from v4launch.model.packing import EntryMemory, make_pack, shift_in_segment
from v4launch.model.parallel import SINGLE_DEVICE, shard_thd_batch
from v4launch.validators.derived import boundary_width

MODEL = Path(__file__).resolve().parents[3] / "model"


def test_shard_thd_batch_slices_contiguously_and_keeps_global_cu():
    tokens, labels = torch.arange(12), torch.arange(12) + 100
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    parts = [shard_thd_batch(tokens, labels, cu, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p.tokens for p in parts]), tokens)
    assert torch.equal(torch.cat([p.labels for p in parts]), labels)
    assert [p.start for p in parts] == [0, 4, 8] and all(p.cu_seqlens is cu and p.T == 12 for p in parts)


def test_shard_thd_batch_errors_name_values_and_fix():
    cu = torch.tensor([0, 10])
    with pytest.raises(ValueError, match=r"T=10 packed tokens is not divisible by cp=4.*Fix: .*12 tokens"):
        shard_thd_batch(torch.zeros(10, dtype=torch.long), None, cu, 0, 4)
    width = boundary_width(8, [0, 4, 128])
    with pytest.raises(ValueError, match=r"L = T/cp = 10/2 = 5 < boundary width 128.*Fix: pack at least 256"):
        shard_thd_batch(torch.zeros(10, dtype=torch.long), None, cu, 1, 2, boundary=width)
    with pytest.raises(ValueError, match=r"cp_rank=2, cp_size=2"):
        shard_thd_batch(torch.zeros(10, dtype=torch.long), None, cu, 2, 2)


def test_mtp_shift_per_rank_equals_the_global_shift():
    """Each rank shifts its slice with its right neighbour's first row (ContextParallelGroup.next_first)."""
    cu = torch.tensor([0, 3, 9, 12])
    x = torch.arange(12) + 10
    full = make_pack(x, cu, 6)
    want = shift_in_segment(x, full, -100)
    for cp in (2, 3, 4):
        L, got = 12 // cp, []
        for r in range(cp):
            rows = slice(r * L, (r + 1) * L)
            local = type(full)(cu=full.cu, lengths=full.lengths, seg=full.seg[rows], pos=full.pos[rows],
                               n_tokens=L, max_seqlen=6)
            after = x[rows.stop:rows.stop + 1] if r < cp - 1 else None
            got.append(shift_in_segment(x[rows], local, -100, after))
        assert torch.equal(torch.cat(got), want), cp


def test_single_device_hooks_do_nothing():
    x = torch.randn(5, 3)
    pack = make_pack(torch.zeros(5, dtype=torch.long), torch.tensor([0, 5]), 5)
    shard = SINGLE_DEVICE.shard(torch.zeros(5, dtype=torch.long), torch.tensor([0, 5]), 5, 8, (4,))
    assert shard.left == 0 and shard.start == 0 and shard.ext is shard.pack
    assert SINGLE_DEVICE.extend(x, shard) is x and SINGLE_DEVICE.next_first(x, 0) is None
    assert SINGLE_DEVICE.sum_partial(x) is x and SINGLE_DEVICE.sum_int(3) == 3
    mem = SINGLE_DEVICE.gather([x], None, shard, "kv")[0]
    assert mem.buf is x and mem.phys is None and SINGLE_DEVICE.tie(x, [mem]) is x
    assert pack.n_tokens == 5


def test_entry_memory_lowers_logical_ids_to_physical_rows():
    buf = torch.arange(8.0)[:, None]  # 2 ranks x capacity 4, rank 0 owns 2 entries, rank 1 owns 3
    mem = EntryMemory(buf, torch.tensor([0, 1, 4, 5, 6]))
    assert mem.rows(1, 4).flatten().tolist() == [1.0, 4.0, 5.0]
    assert mem.at(torch.tensor([[4, 0]])).flatten().tolist() == [6.0, 0.0]


def test_torch_distributed_is_imported_only_in_model_parallel():
    pattern = re.compile(r"torch\.distributed|import torch\.distributed|from torch import distributed")
    offenders = [p.relative_to(MODEL).as_posix() for p in MODEL.rglob("*.py")
                 if pattern.search(p.read_text()) and p.parent.name != "parallel"]
    assert offenders == []
