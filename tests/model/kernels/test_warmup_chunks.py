"""The warm-up KL's query chunks (``layer.warmup_chunks``): one host read for all chunks, the same ranges as
reading each chunk's first entry and largest visible end one by one (the code before), on fresh packed batches."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from v4launch.model.kernels.layer import warmup_chunks
from v4launch.model.packing import compress_plan, make_pack


def naive_chunks(first: torch.Tensor, nvis: torch.Tensor, rows_per: int) -> list[tuple[int, int, int, int]]:
    out = []
    for r0 in range(0, first.shape[0], rows_per):
        r1 = min(first.shape[0], r0 + rows_per)
        lo = int(first[r0])
        hi = max(lo, int((first[r0:r1] + nvis[r0:r1]).max()))
        if hi > lo:
            out.append((r0, r1, lo, hi))
    return out


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), ratio=st.sampled_from([2, 4, 8]),
       rows_per=st.integers(1, 50))
def test_chunks_equal_the_per_chunk_reads(lengths, ratio, rows_per):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    pack = make_pack(torch.zeros(int(cu[-1]), dtype=torch.long), cu, max(lengths))
    plan = compress_plan(pack, ratio)
    first, nvis = plan.seg_offset[pack.seg], plan.n_visible
    got = warmup_chunks(first, nvis, rows_per)
    assert got == naive_chunks(first, nvis, rows_per)
    covered = [r for r0, r1, _, _ in got for r in range(r0, r1)]
    assert all(int(nvis[r]) == 0 for r in range(first.shape[0]) if r not in covered)  # only empty rows left out


def test_no_rows_no_chunks():
    assert warmup_chunks(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 16) == []
