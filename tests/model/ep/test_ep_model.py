"""The whole tiny model (hash, SWA/CSA layers, MTP) under expert parallelism vs one process with all experts.

ep = 2 on 2 ranks (two data-parallel replicas, different tokens); on 4 ranks with
dp = 2 × cp = 2: ep = 2 (EP groups = CP groups, ranks 0 and 2 hold the same experts) and
ep = 4 (one EP group across both CP groups and replicas).
float64: losses, every parameter gradient (expert grads summed over the ranks holding the
expert; others over every rank) within 1e-10 relative; router counts exact. See ep_harness.
"""

from __future__ import annotations

import pytest

from ep_harness import spawn

# 2 decoder layers (hash + SWA, CSA) and an MTP layer; E = 8 so an EP rank holds 4 experts
ARGS = dict(n_layers=2, compress_ratios=(0, 4, 0), n_routed_experts=8, n_activated_experts=2)
_RESULTS: dict = {}


def _results(key: str, world: int, cases: list[dict], tmp_path_factory):
    if key not in _RESULTS:
        _RESULTS[key] = spawn(world, cases, tmp_path_factory.mktemp(key))
    return _RESULTS[key]


def _check(res: list[list[dict]], tol: float, ep: int, n_experts: int) -> None:
    per_rank = n_experts // ep
    for rank, r in enumerate(res):
        assert "balance/layer_00" in r["loss_names"] and "mtp/depth_1" in r["loss_names"], rank
        assert all(v <= tol for v in r["losses"].values()), (rank, r["losses"])
        assert r["expert_grad"] <= tol, (rank, r["worst_expert"], r["expert_grad"])
        assert r["other_grad"] <= tol, (rank, r["worst_other"], r["other_grad"])
        assert r["count_err"] == 0, rank
        ep_rank = rank % ep
        assert r["held"] == list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank)), (rank, r["held"])


@pytest.mark.parametrize("phase,seed", [("dense", 11), ("sparse", 12)])
def test_ep2_matches_one_process_with_all_experts(phase, seed, tmp_path_factory):
    res = _results("ep2", 2, [dict(ep=2, cp=1, seed=s, phase=p, lengths=[9, 14, 7], args=ARGS)
                              for p, s in (("dense", 11), ("sparse", 12))], tmp_path_factory)
    i = 0 if phase == "dense" else 1
    _check([r[i] for r in res], 1e-10, ep=2, n_experts=8)
    assert res[0][i]["n_tokens"] == res[1][i]["n_tokens"] == 30


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_with_cp2_matches_one_process_with_all_experts(ep, tmp_path_factory):
    res = _results("cp2", 4, [dict(ep=2, cp=2, seed=13, phase="sparse", lengths=[11, 21], args=ARGS),
                              dict(ep=4, cp=2, seed=14, phase="dense", lengths=[11, 21], args=ARGS)],
                   tmp_path_factory)
    i = 0 if ep == 2 else 1
    _check([r[i] for r in res], 1e-10, ep=ep, n_experts=8)
    assert all(r[i]["n_tokens"] == 16 for r in res)
