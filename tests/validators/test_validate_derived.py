"""Derived figures: boundary width, all-gather bytes (seed 000 §5.5), capacity, top-k padding, stage figures."""

from __future__ import annotations

import pytest

from validate_helpers import FLASH_4N_SEED_004, RECIPES, validate_file
from v4launch.validators import derived
from v4launch.validators.schema.model import FLASH_COMPRESS_RATIOS, PRO_COMPRESS_RATIOS

MIB = 2**20


@pytest.mark.parametrize(
    ("window", "ratios", "width"),
    [(128, FLASH_COMPRESS_RATIOS, 128), (128, PRO_COMPRESS_RATIOS, 128), (64, [0, 4], 64), (4, [0, 4], 8),
     (4, [4, 128], 128), (16, [0, 0], 16), (1, [4], 8), (200, [128], 200)],
)
def test_boundary_width(window, ratios, width):
    assert derived.boundary_width(window, ratios) == width


def test_seed_305_mib_per_csa_layer_at_one_million_tokens():
    """Seed 000 §5.5: (1e6/4)·(512+128)·2 bytes ≈ 305 MiB per CSA layer, on every CP rank."""
    b = derived.csa_allgather_bytes(10**6)
    assert b == 250_000 * 640 * 2
    assert round(b / MIB) == 305
    assert derived.csa_allgather_bytes(2**20) == 320 * MIB
    # 21 CSA layers of Flash ≈ 6.3 GiB (the seed's figure, decimal 1e6 tokens)
    assert round(21 * b / 2**30, 1) == 6.3


def test_hca_and_dense_mode_bytes():
    assert derived.hca_allgather_bytes(2**20) == (2**20 // 128) * 512 * 2
    assert derived.csa_allgather_bytes(2**20, with_indexer=False) == (2**20 // 4) * 512 * 2
    total = derived.allgather_bytes_total(2**20, FLASH_COMPRESS_RATIOS)
    assert total == 21 * derived.csa_allgather_bytes(2**20) + 20 * derived.hca_allgather_bytes(2**20)


def test_cp_capacity_matches_megatron_formula():
    # ceil_to(max(1, (l_local + d_comp)//ratio), 32//gcd(32, ratio))
    assert derived.cp_capacity_rows(131072, 4) == 32776  # (131080//4 = 32770) → multiple of 8
    assert derived.cp_capacity_rows(131072, 128) == 1025  # (131072 + 128)//128, align 1
    assert derived.cp_capacity_rows(3, 4) == 8
    padded = derived.padded_allgather_bytes(2**20, 8, 4, 640)
    assert padded >= derived.csa_allgather_bytes(2**20) and padded - derived.csa_allgather_bytes(2**20) <= 8 * 8 * 640 * 2


@pytest.mark.parametrize(("topk", "sm", "waste"), [(512, 90, 0), (1000, 90, 24), (1000, 100, 24), (960, 90, 64),
                                                    (960, 100, 0), (16, 90, 112), (16, None, 0), (64, 103, 0)])
def test_topk_padding(topk, sm, waste):
    assert derived.topk_padding_waste(topk, sm) == waste
    assert derived.topk_alignment(sm) == (None if sm is None else 64 if sm >= 100 else 128)


def test_local_rows_and_visible_entries():
    assert derived.local_rows(2**20, 8) == 131072
    assert derived.visible_compressed_entries(65536) == 16384


def test_stage_figures_in_report():
    report = validate_file(RECIPES / "flash_4n.yaml")
    figs = {s.name: s.derived for s in report.stages}
    one_m = figs["sparse_1m"]
    assert one_m["local_rows"] == 32768 and one_m["boundary_width"] == 128 and one_m["dp"] == 1  # cp 32
    assert one_m["csa_allgather_bytes_per_layer"] == derived.csa_allgather_bytes(2**20)
    assert one_m["allgather_bytes_total"] == derived.allgather_bytes_total(2**20, FLASH_COMPRESS_RATIOS)
    dense = figs["dense_64k"]  # cp 4, no indexer in the dense phase: the compressed KV alone is gathered
    assert (dense["cp"], dense["dp"], dense["local_rows"]) == (4, 8, 16384)
    assert dense["allgather_bytes_total"] == derived.allgather_bytes_total(65536, FLASH_COMPRESS_RATIOS,
                                                                           with_indexer=False) > 0
    assert one_m["topk_alignment"] == 128 and one_m["topk_padding_waste"] == 0
    assert one_m["pp_stage_gflop_per_token"] is None and one_m["pp_balance"] is None  # PP1
    seed_004 = {s.name: s.derived for s in validate_file(RECIPES / "flash_4n.yaml", FLASH_4N_SEED_004).stages}
    assert seed_004["sparse_1m"]["local_rows"] == 131072 and seed_004["sparse_1m"]["dp"] == 1  # cp 8 of 8
    assert seed_004["dense_64k"]["allgather_bytes_total"] == 0  # CP = 1: no all-gather
    assert len(seed_004["sparse_1m"]["pp_stage_gflop_per_token"]) == 4 and seed_004["sparse_1m"]["pp_balance"] <= 1.25
    pro = {s.name: s.derived for s in validate_file(RECIPES / "pro.yaml").stages}
    assert pro["sparse_1m"]["topk_alignment"] == 64 and len(pro["sparse_1m"]["pp_stage_gflop_per_token"]) == 16


def test_pp_stage_costs_function():
    from v4launch.validators.schema import ModelConfig

    costs = derived.pp_stage_costs("Et*10|t*12|t*12|t*9mL", ModelConfig(), 65536)
    assert len(costs) == 4 and all(c > 0 for c in costs)
