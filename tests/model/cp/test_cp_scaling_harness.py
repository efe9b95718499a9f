"""The CP scaling benchmark (benchmarks/cp_scaling.py) at world 2 on gloo with tiny dims.

Launched as the multi-GPU run is (torchrun, CP = world), so the harness that will run on
GPUs is exercised end to end on CPU: parity of CP = 2 against CP = 1 in bf16 and float32
passes, and the bytes the runtime counts per layer equal the validator's figures
(``v4launch.validators.derived``), computed here independently. The ``--compare`` mode
reads a CP = 1 and a CP = 2 file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from v4launch.validators.derived import (boundary_width, csa_allgather_bytes, hca_allgather_bytes,
                                         padded_allgather_bytes)

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "cp_scaling.py"
T = 256  # tiny dims: dim 32, head_dim 16, index_head_dim 16, window 8, boundary width 128 (HCA)


def _run(out: Path, world: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(SCRIPT),
           "--tiny", "--sizes", str(T), "--parity-T", "256", "--parity-dtypes", "bf16,fp32", "--repeats", "1",
           "--comm-reps", "1", "--out", str(out), *extra]
    env = dict(os.environ)
    if world == 1:  # plain python: a world of one on a free port (no launcher start-up)
        cmd = [sys.executable] + cmd[5:]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("cp_scaling") / "cp2.json"
    return out, _run(out, 2)


@pytest.mark.slow
def test_cp2_gloo_tiny_parity_and_bytes(cp2):
    res = cp2[1]
    assert res["meta"]["cp"] == 2 and res["meta"]["backend"] == "gloo"
    assert len(res["parity"]) == 6  # SWA, CSA sparse, HCA x bf16, fp32
    for p in res["parity"]:
        assert p["ok"], p
        if p["dtype"] == "fp32":
            assert p["max_rel"] <= 1e-4, p
        else:
            assert p["min_cos"] >= 1 - 1e-3, p
    rows = {r["layer"]: r for r in res["rows"]}
    assert set(rows) == {"SWA", "CSA", "HCA"}
    B = boundary_width(8, (0, 0, 4, 128))
    for name, r in rows.items():
        assert "error" not in r and r["bytes_ok"], r
        assert r["step_ms"] > 0 and r["tok_s_gpu"] > 0
        sent = [t["boundary_fwd_sent"] for t in r["traffic_ranks"]]
        assert sent == [B * 32 * 2, 0], (name, sent)  # rank 0 -> rank 1: B bf16 rows of dim 32
        assert [t["boundary_fwd_recv"] for t in r["traffic_ranks"]] == [0, B * 32 * 2]
        assert r["validator"]["boundary"] == B * 32 * 2
    csa, hca = rows["CSA"], rows["HCA"]
    assert csa["elem_bytes"] == hca["elem_bytes"] == 2  # the gathered buffer is bf16, as the validator assumes
    for r, ratio, width, logical in ((csa, 4, 32, csa_allgather_bytes(T, kv_dim=16, index_dim=16)),
                                     (hca, 128, 16, hca_allgather_bytes(T, kv_dim=16))):
        padded = padded_allgather_bytes(T, 2, ratio, width)
        for t in r["traffic_ranks"]:
            assert t["allgather_fwd_recv"] == padded and t["allgather_fwd_sent"] * 2 == padded
            assert t["allgather_bwd"] == padded and t["n_allgather"] == 2
        assert r["owned_bytes_total"] == logical <= padded
        assert r["validator"]["padded"] == padded and r["validator"]["logical"] == logical
    assert rows["SWA"]["traffic_ranks"][0]["n_allgather"] == 0


@pytest.mark.slow
def test_compare_mode_reads_cp1_and_cp2(cp2, tmp_path):
    one = tmp_path / "cp1.json"
    assert _run(one, 1, "--parity-T", "0", "--layers", "CSA")["meta"]["cp"] == 1
    p = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(one), str(cp2[0])],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr  # CPU: no peak memory, so no gate fails
    assert "| CSA | 256 | 2 |" in p.stdout and "< 0.65x" in p.stdout
    assert "cp=2 CSA fp32 T=256: PASS" in p.stdout
