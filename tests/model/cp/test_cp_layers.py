"""CP = 2 and CP = 4 attention layers against CP = 1 on the same packed batch (gloo, CPU).

Compares local outputs, input gradients, CP-summed parameter gradients and the indexer
KL for ratios 0, 4 (dense, warm-up and sparse KL targets) and 128 on ragged packs whose
segments cross rank boundaries and end in tails shorter than the ratio, with local rows
equal to the boundary width, and counts the bytes of every collective against the
validator's figures (seed 000 §5–6; megatron-v4-contract §3–4).
"""

from __future__ import annotations

import pytest

from cp_harness import spawn
from v4launch.validators.derived import (boundary_width, cp_capacity_rows, csa_allgather_bytes, hca_allgather_bytes,
                                         padded_allgather_bytes)

RAGGED = [1, 3, 37, 6, 30, 19]  # T = 96: one token, tails of 1-3 tokens, segments across every rank boundary
HCA = [5, 300, 150, 57]  # T = 512: 300 % 128 = 44-token tail; CP=4 holds exactly 128 = boundary rows
TIGHT = {2: [2, 2, 2, 2, 8], 4: [2, 2, 2, 2, 24]}  # L = 8 = boundary width; rank 0 sees no entry at all
DIM, HEAD, INDEX = 32, 16, 16  # tiny_args: dim, head_dim, index_head_dim
TOL = {"float64": 1e-10, "float32": 1e-5}


def _cases(cp: int) -> list[dict]:
    layer = [dict(ratio=0, phase="dense", lengths=RAGGED, seed=1),
             dict(ratio=4, phase="dense", lengths=RAGGED, seed=2),
             dict(ratio=4, phase="warmup", lengths=RAGGED, seed=3),
             dict(ratio=4, phase="sparse", lengths=RAGGED, seed=4),
             dict(ratio=128, phase="dense", lengths=HCA, seed=5),
             dict(ratio=4, phase="sparse", lengths=TIGHT[cp], seed=6, chunk=4),
             dict(ratio=4, phase="warmup", lengths=TIGHT[cp], seed=7),
             dict(ratio=0, phase="dense", lengths=TIGHT[cp], seed=8),
             dict(ratio=4, phase="sparse", lengths=RAGGED, seed=9, dtype="float32"),
             dict(ratio=4, phase="warmup", lengths=[96], seed=10),  # one segment: byte counts
             dict(ratio=128, phase="dense", lengths=[512], seed=11)]
    # the kernel-path layer code (kernels.layer.attention_forward) at CP = world against the CP = 1 reference
    layer += [dict(c, seed=c["seed"] + 40, kernels=True) for c in layer[:6]]
    return ([dict(c, kind="layer") for c in layer] + [dict(kind="gather_dtypes", seed=12)]
            + [dict(kind="errors", local=4, width_window=8)])


CASES = _cases(2)
_RESULTS: dict[int, list] = {}


def _results(cp: int, tmp_path_factory) -> list[list[dict]]:
    if cp not in _RESULTS:
        _RESULTS[cp] = spawn(cp, _cases(cp), tmp_path_factory.mktemp(f"cp{cp}"))
    return _RESULTS[cp]


def _id(c: dict) -> str:
    if c["kind"] != "layer":
        return "errors"
    return (f"r{c['ratio']}-{c['phase']}-T{sum(c['lengths'])}-{c.get('dtype', 'float64')}"
            + ("-kernel-path" if c.get("kernels") else ""))


CP_SIZES = [2, 4]
LAYER_IDX = [i for i, c in enumerate(CASES) if c["kind"] == "layer"]


@pytest.mark.parametrize("cp", CP_SIZES)
@pytest.mark.parametrize("i", LAYER_IDX, ids=[_id(CASES[i]) for i in LAYER_IDX])
def test_layer_matches_cp1(cp, i, tmp_path_factory):
    case = _cases(cp)[i]
    tol = TOL[case.get("dtype", "float64")]
    for rank, res in enumerate(_results(cp, tmp_path_factory)):
        r = res[i]
        where = f"cp={cp} rank={rank}"
        assert r["out"] <= tol and r["x_grad"] <= tol, (where, r)
        assert r["param_grad"] <= tol, (where, r["worst"], r["param_grad"])
        if case["phase"] != "dense" and case["ratio"] == 4:
            assert r["kl"] <= tol and r["kl_value"] > 0, (where, r)
            assert r["kl_only_grad"] <= tol, (where, r["kl_only_grad"])  # backward of the KL alone
        else:
            assert r["kl"] is None
        assert r["boundary"] == boundary_width(8, [case["ratio"]]) <= r["local_rows"]


@pytest.mark.parametrize("cp", CP_SIZES)
def test_owned_entries_partition_the_global_entries(cp, tmp_path_factory):
    res = _results(cp, tmp_path_factory)
    for i in LAYER_IDX:
        case = _cases(cp)[i]
        if not case["ratio"]:
            continue
        expected = sum(n // case["ratio"] for n in case["lengths"])
        assert sum(res[rank][i]["owned"] for rank in range(cp)) == res[0][i]["entries"] == expected
        assert all(res[rank][i]["owned"] <= res[rank][i]["capacity"] for rank in range(cp))
        assert res[0][i]["capacity"] == cp_capacity_rows(sum(case["lengths"]) // cp, case["ratio"])


def _fwd(records, op, key="sent"):
    return sum(r[key] for r in records if r["op"] == op and r["direction"] == "forward")


@pytest.mark.parametrize("cp", CP_SIZES)
def test_allgather_bytes_match_the_validator(cp, tmp_path_factory):
    """Per layer, every rank receives the padded buffer ``padded_allgather_bytes`` and
    contributes 1/cp of it; the logical payload (owned rows only) is the validator's
    ``csa_allgather_bytes`` / ``hca_allgather_bytes`` (float64 here: 8 bytes per element)."""
    res = _results(cp, tmp_path_factory)
    cases = _cases(cp)
    by_seed = {c.get("seed"): i for i, c in enumerate(cases)}
    for i, (ratio, width, logical) in {
        by_seed[10]: (4, HEAD + INDEX, csa_allgather_bytes(96, kv_dim=HEAD, index_dim=INDEX, elem_bytes=8)),
        by_seed[11]: (128, HEAD, hca_allgather_bytes(512, kv_dim=HEAD, elem_bytes=8)),
    }.items():
        T = sum(cases[i]["lengths"])
        padded = padded_allgather_bytes(T, cp, ratio, width, elem_bytes=8)
        owned_bytes = 0
        for rank in range(cp):
            rec = res[rank][i]["traffic"]
            assert _fwd(rec, "allgather", "received") == padded
            assert _fwd(rec, "allgather", "sent") == padded // cp == cp_capacity_rows(T // cp, ratio) * width * 8
            assert len([r for r in rec if r["op"] == "allgather"]) == 2  # one per layer forward, one backward
            left = boundary_width(8, [ratio])
            assert _fwd(rec, "boundary") == (left * DIM * 8 if rank < cp - 1 else 0)
            owned_bytes += res[rank][i]["owned"] * width * 8
        assert owned_bytes == logical <= padded
    # dense-mode CSA gathers the main KV only (no indexer): the validator's with_indexer=False
    dense = cases.index(next(c for c in cases if c.get("phase") == "dense" and c.get("ratio") == 4))
    T = sum(cases[dense]["lengths"])
    assert _fwd(res[0][dense]["traffic"], "allgather", "received") == padded_allgather_bytes(T, cp, 4, HEAD, 8)


def test_clear_errors_for_short_local_rows_and_foreign_batches(tmp_path_factory):
    msgs = _results(2, tmp_path_factory)[0][len(CASES) - 1]
    assert "local rows L=4 < boundary width 8" in msgs["short"] and "Fix:" in msgs["short"]
    assert "cu_seqlens[-1]=100" in msgs["global"] and "cp=2" in msgs["global"] and "Fix:" in msgs["global"]


@pytest.mark.parametrize("cp", CP_SIZES)
def test_gathered_parts_keep_their_own_dtypes(cp, tmp_path_factory):
    """One all-gather carries the compressed KV and the indexer keys; the buffer holds their promoted dtype, and
    each part must come back in its own: bf16 keys returned as float32 beside bf16 queries sent the KL student to
    float32 products on the CUDA cores (~24x slower; the kernels now refuse two dtypes)."""
    i = next(j for j, c in enumerate(CASES) if c["kind"] == "gather_dtypes")
    for rank in _results(cp, tmp_path_factory):
        assert rank[i]["dtypes"] == ["torch.float32", "torch.bfloat16"] and rank[i]["own_rows"], rank[i]
