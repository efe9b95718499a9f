"""Muon and AdamW on FSDP-sharded (DTensor) parameters equal torch's optimizers on whole tensors; API errors.

Two gloo ranks, parameters ``Shard(0)`` over both with uneven row counts (7 rows: 4 + 3), a row
count below the world size (1 row: rank 1 holds an empty shard) and tall, wide and square
matrices. The same gradients reach the sharded and the whole parameters, so the gathered Muon
update is the whole update to the bit, and bf16 Newton-Schulz gives bitwise torch.optim.Muon.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_harness import spawn

SHAPES = [(7, 5), (1, 4), (3, 8), (8, 3), (6, 6), (2, 9)]
CASES = [dict(kind="optim", optimizer="muon", shapes=SHAPES, steps=4),
         dict(kind="optim", optimizer="adamw", shapes=SHAPES, steps=4),
         dict(kind="errors")]
_RESULTS: dict = {}


def _results(tmp_path_factory):
    if not _RESULTS:
        seed = int(torch.randint(0, 2**20, (1,)).item())
        print(f"seed: {seed}")
        _RESULTS["r"] = spawn(2, [dict(c, seed=seed) for c in CASES], tmp_path_factory.mktemp("optim"))
    return _RESULTS["r"]


@pytest.mark.parametrize("i", [0, 1], ids=["muon", "adamw"])
def test_sharded_step_equals_torch_on_whole_tensors(i, tmp_path_factory):
    for rank, res in enumerate(_results(tmp_path_factory)):
        r = res[i]
        assert r["local_rows"] == [[4, 1, 2, 4, 3, 1], [3, 0, 1, 4, 3, 1]][rank]
        assert r["state_types"] == ["DTensor"]  # optimizer state is sharded like the parameter
        assert r["param"][0] <= 1e-12 and r["state"][0] <= 1e-12, (rank, r)


def test_errors_name_the_rule_and_the_fix(tmp_path_factory):
    msgs = _results(tmp_path_factory)[0][2]
    assert "dp=3 must divide the shard group size S = dp*cp = 2" in msgs["dp"] and "Fix:" in msgs["dp"]
    assert "not sharded" in msgs["unsharded"] and "apply_fsdp" in msgs["unsharded"]
    assert "dp=0" in msgs["reduce_dp"]
    assert "float32" in msgs["dtypes"] and "float64" in msgs["dtypes"] and "Fix:" in msgs["dtypes"]
    assert "dp=4" in msgs["dp_after"]
    assert "DTensor" in msgs["reduce_sharded"]
