"""The key-major backward's work plan (``model.kernels.key_major``) against brute force.

For every block of kv rows, the planned query interval [QS, QE) must hold every query whose
range meets the block (else a gradient contribution is lost) and nothing but queries with
an empty range besides; the splits must cover the longest interval. Model-shaped ranges
(packed segments, sliding window, HCA / dense-CSA visible entries) drawn by hypothesis.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from v4launch.model.kernels.key_major import key_major_plan


def model_ranges(lengths: list[int], window: int, ratio: int, with_entries: bool) -> tuple[torch.Tensor, int]:
    T = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = torch.arange(T)
    pos = t - cu[seg]
    counts = torch.tensor(lengths) // ratio
    first = (torch.cumsum(counts, 0) - counts)[seg]
    a_lo = torch.maximum(t - pos, t - window + 1)
    b_lo = T + first if with_entries else t * 0
    b_hi = b_lo + (pos + 1) // ratio if with_entries else t * 0
    return torch.stack((a_lo, t + 1, b_lo, b_hi), 1).int(), T + int(counts.sum())


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=5), window=st.integers(1, 64),
       ratio=st.sampled_from([4, 16, 128]), with_entries=st.booleans(), block=st.sampled_from([16, 64]),
       n_sm=st.integers(1, 8))
def test_plan_covers_exactly_the_queries_of_each_block(lengths, window, ratio, with_entries, block, n_sm):
    ranges, n_rows = model_ranges(lengths, window, ratio, with_entries)
    plan = key_major_plan(ranges, n_rows, block, n_sm)
    assert plan is not None
    lo, hi = ranges[:, 0::2].long(), ranges[:, 1::2].long()
    planned = {w[0]: w for w in plan}
    for r in (0, 1):
        if not bool((hi[:, r] > lo[:, r]).any()):
            assert r not in planned
            continue
        _, first, qs, qe, splits, qchunk = planned[r]
        assert splits * qchunk >= int((qe - qs).max())
        for b, n0 in enumerate(range(first, first + block * qs.shape[0], block)):
            n1 = n0 + block
            meets = ((lo[:, r] < n1) & (hi[:, r] > n0) & (hi[:, r] > lo[:, r])).nonzero().flatten().tolist()
            inside = set(range(int(qs[b]), int(qe[b])))
            assert set(meets) <= inside, (r, n0, meets, qs[b], qe[b])
            for t in inside - set(meets):
                assert lo[t, r] == hi[t, r] or not (lo[t, r] < n1 and hi[t, r] > n0), t
        # every row any query reads lies in a planned block
        rows = torch.cat([torch.arange(int(a), int(z)) for a, z in zip(lo[:, r], hi[:, r])])
        assert int(rows.min()) >= first and int(rows.max()) < first + block * qs.shape[0]


def test_plan_refuses_decreasing_bounds():
    ranges = torch.tensor([[0, 5, 0, 0], [3, 6, 0, 0], [1, 7, 0, 0]], dtype=torch.int32)
    assert key_major_plan(ranges, 8, 4, 1) is None


def test_plan_without_ranges_or_queries():
    assert key_major_plan(torch.zeros(0, 4, dtype=torch.int32), 0, 16, 1) == []
    assert key_major_plan(torch.zeros(5, 4, dtype=torch.int32), 10, 16, 1) == []
