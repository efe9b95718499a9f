"""PackedBatchLoader: THD invariants (hypothesis), resume parity, DP and seq_len changes, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from v4launch.data.packing import IGNORE_INDEX, PackedBatch, PackedBatchLoader

HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# document lengths: empty, 1, shorter than a CSA group (4), shorter than an HCA group (128), longer than a row
lengths_st = st.lists(st.one_of(st.just(0), st.just(1), st.integers(2, 3), st.integers(4, 127), st.integers(128, 300)),
                      min_size=1, max_size=25).filter(lambda ls: sum(ls) > 0)


def expected_layout(segments, seq_len: int, mbs: int) -> tuple[list[int], list[bool]]:
    """cu_seqlens and real/padding flags implied by greedy packing of ``segments`` into rows."""
    rows: list[list] = []
    for seg in segments:
        epoch, _, _, n = seg
        cur = rows[-1] if rows else None
        if cur is None or cur[0][0] != epoch or sum(x[3] for x in cur) + n > seq_len:
            rows.append([seg])
        else:
            cur.append(seg)
    cu, real = [0], []
    for r in range(mbs):
        for seg in rows[r] if r < len(rows) else []:
            cu.append(cu[-1] + seg[3])
            real.append(True)
        if cu[-1] < (r + 1) * seq_len:
            cu.append((r + 1) * seq_len)
            real.append(False)
    return cu, real


def check_batch(b: PackedBatch, docs: list[np.ndarray], seq_len: int, mbs: int = 1) -> None:
    """Shape, cu_seqlens (greedy, fixed capacity), labels at boundaries and on padding, token provenance."""
    T = seq_len * mbs
    assert b.tokens.shape == (T,) and b.labels.shape == (T,) and b.tokens.dtype == torch.int64
    cu = b.cu_seqlens
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == T
    assert bool((cu[1:] > cu[:-1]).all()) and b.max_seqlen == int((cu[1:] - cu[:-1]).max())
    want_cu, real = expected_layout(b.segments, seq_len, mbs)
    assert cu.tolist() == want_cu
    segs = iter(b.segments)
    for (s, e), is_real in zip(zip(want_cu[:-1], want_cu[1:]), real):
        lab = b.labels[s:e]
        if not is_real:
            assert bool((lab == IGNORE_INDEX).all())
            continue
        _, doc, off, n = next(segs)
        assert n == e - s <= seq_len
        assert torch.equal(b.tokens[s:e], torch.from_numpy(docs[doc][off:off + n].astype(np.int64)))
        assert int(lab[-1]) == IGNORE_INDEX and torch.equal(lab[:-1], b.tokens[s + 1:e])
    assert b.num_real_tokens == sum(x[3] for x in b.segments) and b.num_docs == len(b.segments)


def coverage(segments, docs) -> None:
    """Epoch-0 segments tile every document exactly once (no skip, no repeat)."""
    per_doc: dict[int, list[tuple[int, int]]] = {}
    for epoch, doc, off, n in segments:
        if epoch == 0:
            per_doc.setdefault(doc, []).append((off, n))
    for i, d in enumerate(docs):
        pieces = sorted(per_doc.get(i, []))
        pos = 0
        for off, n in pieces:
            assert off == pos, f"doc {i}: gap or repeat at {pos} (piece at {off})"
            pos += n
        assert pos == d.size, f"doc {i}: covered {pos} of {d.size} tokens"


def draw_rounds(loaders, rounds: int) -> list:
    out = []
    for _ in range(rounds):
        for ld in loaders:
            out.append(next(ld))
    return out


def run_epoch(loaders) -> list:
    """Draw lockstep rounds until the global position leaves epoch 0."""
    out = []
    while loaders[0].epoch == 0:
        out += draw_rounds(loaders, 1)
    return out


def row_fill(b: PackedBatch, seq_len: int) -> list[tuple[int, int]]:
    """(epoch, real tokens) of each row of ``b`` (from its segments, rows in order; rows never mix epochs)."""
    rows: list[list[int]] = []
    for epoch, _, _, n in b.segments:
        if not rows or rows[-1][0] != epoch or rows[-1][1] + n > seq_len:
            rows.append([epoch, 0])
        rows[-1][1] += n
    return [(e, n) for e, n in rows]


@HYP
@given(lengths=lengths_st, seq_len=st.integers(1, 160), dp=st.integers(1, 3), mbs=st.integers(1, 2), seed=st.integers(0, 9),
       fill=st.booleans())
def test_every_token_once_per_epoch_across_ranks(make_dataset, lengths, seq_len, dp, mbs, seed, fill):
    prefix, docs = make_dataset(lengths, seed)
    loaders = [PackedBatchLoader(prefix, seq_len, seed, r, dp, mbs, fill_rows=fill) for r in range(dp)]
    batches = run_epoch(loaders)
    for b in batches:
        check_batch(b, docs, seq_len, mbs)
    coverage([s for b in batches for s in b.segments], docs)
    if fill:  # data.packing=fill_rows: every row of epoch 0 is full but its last one
        rows = [n for b in batches for e, n in row_fill(b, seq_len) if e == 0]
        assert all(n == seq_len for n in rows[:-1]), rows
    assert len({ld.epoch for ld in loaders}) == 1
    assert loaders[0].state_dict() == loaders[-1].state_dict()


@HYP
@given(lengths=lengths_st, seq_len=st.integers(1, 160), k=st.integers(0, 12), fill=st.booleans())
def test_resume_parity(make_dataset, lengths, seq_len, k, fill):
    prefix, docs = make_dataset(lengths)
    a = PackedBatchLoader(prefix, seq_len, 3, 0, 1, fill_rows=fill)
    draw_rounds([a], k)
    state = a.state_dict()
    b = PackedBatchLoader(prefix, seq_len, 3, 0, 1, fill_rows=fill)
    b.load_state_dict(state)
    for _ in range(8):
        x, y = next(a), next(b)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.cu_seqlens, y.cu_seqlens) and x.segments == y.segments


@HYP
@given(lengths=lengths_st, seq_len=st.integers(1, 160), new_seq_len=st.integers(1, 200), k=st.integers(0, 6),
       dp=st.integers(1, 3), new_dp=st.integers(1, 3), fill=st.booleans(), new_fill=st.booleans())
def test_dp_and_seq_len_change_continue_without_skip_or_repeat(make_dataset, lengths, seq_len, new_seq_len, k, dp, new_dp,
                                                              fill, new_fill):
    """Also across a change of data.packing (the state is a cursor either way)."""
    prefix, docs = make_dataset(lengths)
    first = [PackedBatchLoader(prefix, seq_len, 5, r, dp, fill_rows=fill) for r in range(dp)]
    before = draw_rounds(first, k)
    state = first[0].state_dict()
    assert all(ld.state_dict() == state for ld in first)
    second = [PackedBatchLoader(prefix, new_seq_len, 5, r, new_dp, fill_rows=new_fill) for r in range(new_dp)]
    for ld in second:
        ld.load_state_dict(state)
    after = run_epoch(second) if second[0].epoch == 0 else []
    for b in after:
        check_batch(b, docs, new_seq_len)
    coverage([s for b in before + after for s in b.segments], docs)
    assert second[0].micro_batches_consumed == state["micro_batches_consumed"] + len(after)


def test_dp_two_to_one_explicit(make_dataset):
    prefix, docs = make_dataset([50, 700, 3, 0, 1, 260, 90, 128, 40] * 3)
    r0, r1 = (PackedBatchLoader(prefix, 256, 0, r, 2) for r in range(2))
    got = draw_rounds([r0, r1], 5)
    assert [b.segments for b in got[0::2]] != [b.segments for b in got[1::2]]  # ranks see different data
    solo = PackedBatchLoader(prefix, 256, 0, 0, 1)
    solo.load_state_dict(r1.state_dict())
    got += run_epoch([solo])
    coverage([s for b in got for s in b.segments], docs)


def test_long_document_split_into_row_sized_pieces(make_dataset):
    prefix, docs = make_dataset([10, 1000])
    ld = PackedBatchLoader(prefix, 256, 0, 0, 1, shuffle=False)
    b0 = next(ld)
    assert b0.segments == ((0, 0, 0, 10),)  # the long document does not fit the rest: next row
    assert b0.cu_seqlens.tolist() == [0, 10, 256] and bool((b0.labels[10:] == IGNORE_INDEX).all())
    pieces = [next(ld).segments for _ in range(4)]
    assert pieces == [((0, 1, 0, 256),), ((0, 1, 256, 256),), ((0, 1, 512, 256),), ((0, 1, 768, 232),)]


def test_fill_rows_cuts_the_document_that_does_not_fit_at_the_row_end(make_dataset):
    prefix, docs = make_dataset([10, 1000, 20])
    ld = PackedBatchLoader(prefix, 256, 0, 0, 1, shuffle=False, fill_rows=True)
    got = [next(ld) for _ in range(5)]
    assert got[0].segments == ((0, 0, 0, 10), (0, 1, 0, 246))  # no padding: the long document fills the row
    assert got[0].cu_seqlens.tolist() == [0, 10, 256] and got[0].num_real_tokens == 256
    assert int(got[0].labels[9]) == IGNORE_INDEX and int(got[0].labels[255]) == IGNORE_INDEX  # no label crosses
    assert [b.segments for b in got[1:]] == [((0, 1, 246, 256),), ((0, 1, 502, 256),), ((0, 1, 758, 242), (0, 2, 0, 14)),
                                             ((0, 2, 14, 6),)]  # the epoch's last row is short (padding after it)
    assert got[4].cu_seqlens.tolist() == [0, 6, 256]
    whole = PackedBatchLoader(prefix, 256, 0, 0, 1, shuffle=False)
    assert next(whole).num_real_tokens == 10  # the default moves the long document to the next row


def test_evaluation_batches_same_count_on_every_rank(make_dataset):
    prefix, docs = make_dataset([30, 300, 5, 77, 0, 129, 64])
    per_rank = [list(PackedBatchLoader(prefix, 128, 0, r, 3, shuffle=False).evaluation_batches()) for r in range(3)]
    assert len({len(x) for x in per_rank}) == 1
    for bs in per_rank:
        for b in bs:
            check_batch(b, docs, 128)
    coverage([s for bs in per_rank for b in bs for s in b.segments], docs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(seq_len=0), "seq_len"), (dict(dp_size=0), "dp_size"), (dict(dp_rank=2, dp_size=2), "dp_rank"),
    (dict(dp_rank=-1), "dp_rank"), (dict(micro_batch_size=0), "micro_batch_size"),
])
def test_bad_arguments_name_the_argument(make_dataset, kwargs, name):
    prefix, _ = make_dataset([5])
    args = dict(prefix=prefix, seq_len=8, seed=0, dp_rank=0, dp_size=1) | kwargs
    with pytest.raises(ValueError, match=name):
        PackedBatchLoader(**args)


def test_state_from_another_dataset_or_seed_is_refused(make_dataset):
    prefix, _ = make_dataset([5, 6, 7])
    other, _ = make_dataset([5, 6])
    state = PackedBatchLoader(prefix, 8, 0, 0, 1).state_dict()
    with pytest.raises(ValueError, match="num_docs"):
        PackedBatchLoader(other, 8, 0, 0, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PackedBatchLoader(prefix, 8, 1, 0, 1).load_state_dict(state)


def test_missing_dataset_names_the_prefix(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.bin"):
        PackedBatchLoader(tmp_path / "nothing", 8, 0, 0, 1)
