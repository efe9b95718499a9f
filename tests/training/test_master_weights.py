"""fp32 masters as a bf16 value plus a 16-bit remainder (v4launch.training.master_weights): bitwise round
trips, the ties-away rounding checked against an independent reference, and the storage options."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from v4launch.training.master_weights import (MASTER_PARAM, MASTER_REMAINDER, StorageOptions, join_master,
                                              round_ties_away_, split_master, split_master_, storage_for)

NAN_CARRY = 0x7FFF8000
"""Magnitudes from here up are NaNs whose rounding would carry into the sign: they need not round-trip."""


def _float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bf16_value(bits16: int) -> float:
    """A bf16 pattern's value; the pattern above the largest finite magnitude (0x7F80, inf) counts as 2^128."""
    if bits16 & 0x7FFF == 0x7F80:
        return -(2.0**128) if bits16 & 0x8000 else 2.0**128
    return _float(bits16 << 16)


def _ties_away(bits: int) -> int:
    """bf16 pattern of the fp32 pattern ``bits`` (finite) rounded to nearest, ties away from zero, by VALUE:
    the two bf16 neighbours around x in magnitude, the nearer one, the larger magnitude on a tie."""
    x = _float(bits)
    toward_zero = bits >> 16
    away = toward_zero + 1  # next bf16 magnitude (same sign): 0x7F7F + 1 is inf
    if bits & 0xFFFF == 0:
        return toward_zero
    low, high = _bf16_value(toward_zero), _bf16_value(away)
    return toward_zero if abs(x - low) < abs(high - x) else away  # exact in float64: fp32 values 2^-16 ulp apart


def _check_patterns(patterns: list[int]) -> None:
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in patterns], dtype=torch.int32)
    master = bits.view(torch.float32)
    param, remainder = split_master(master)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16 and param.shape == master.shape
    joined = join_master(param, remainder).view(torch.int32)
    for i, b in enumerate(patterns):
        mag = b & 0x7FFFFFFF
        if mag >= NAN_CARRY:
            assert torch.isnan(param[i]), hex(b)  # stays a NaN, no crash
            continue
        assert joined[i].item() == bits[i].item(), hex(b)  # bitwise round trip
        if mag == 0x7F800000:
            assert torch.isinf(param[i]) and param[i].item() * _float(b) > 0, hex(b)
            continue
        if mag > 0x7F800000:  # NaN: a quiet one (what arithmetic makes) stays a NaN
            assert torch.isnan(param[i]) or not mag & 0x400000, hex(b)
            continue
        got = param[i].view(torch.int16).item() & 0xFFFF
        assert got == _ties_away(b), (hex(b), hex(got))
        if got & 0x7FFF != 0x7F80:  # within half an ulp of x (unless it overflowed to inf)
            ulp = abs(_bf16_value((got & 0x8000) | ((got & 0x7FFF) + 1)) - _bf16_value(got))
            assert abs(_bf16_value(got) - _float(b)) <= ulp / 2, hex(b)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_random_bit_patterns_round_trip_and_round_ties_away(patterns):
    _check_patterns(patterns)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 0xFFFF), st.sampled_from([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])),
                min_size=1, max_size=64))
def test_crafted_low_halves_ties_and_neighbours(pairs):
    _check_patterns([hi << 16 | lo for hi, lo in pairs])


def test_crafted_values_zeros_subnormals_ties_and_large():
    patterns = [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00008000, 0x80008000, 0x007FFFFF, 0x807FFFFF,
                0x3F808000, 0xBF808000, 0x3F818000, 0xBF818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7F7FFF, 0x7F7F8000,
                0xFF7F8000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF]
    _check_patterns(patterns)
    assert split_master(torch.tensor([1.0 + 2.0**-8]))[0].item() == 1.0 + 2.0**-7  # a tie goes away from zero
    assert split_master(torch.tensor([-(1.0 + 2.0**-8)]))[0].item() == -(1.0 + 2.0**-7)


def test_every_high_half_with_every_kind_of_low_half():
    """All 2^16 high halves x {0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, random}: round trip, and against torch's
    own round-to-nearest-even: equal off ties; on ties the larger magnitude, half a bf16 ulp away."""
    high = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    rand = torch.randint(0, 1 << 16, (high.numel(),), dtype=torch.int32)
    bits = torch.cat([(high[:, None] * 65536 + lows).flatten(), high * 65536 + rand])
    master = bits.view(torch.float32)
    param, remainder = split_master(master)
    keep = (bits & 0x7FFFFFFF) < NAN_CARRY
    assert torch.equal(join_master(param, remainder).view(torch.int32)[keep], bits[keep])
    finite = torch.isfinite(master)
    tie = (bits & 0xFFFF) == 0x8000
    rne = master.to(torch.bfloat16)
    assert torch.equal(param[finite & ~tie].view(torch.int16), rne[finite & ~tie].view(torch.int16))
    ties = finite & tie & torch.isfinite(param.float())
    up, x = param[ties].double().abs(), master[ties].double().abs()
    down = (bits[ties] & -0x10000).view(torch.float32).double().abs()  # the other neighbour (low half dropped)
    assert bool((param[ties].double().sign() == master[ties].double().sign()).all())
    assert bool((up > x).all()) and torch.equal(up - x, x - down)  # midway, and the larger magnitude taken


def test_in_place_variants_write_into_existing_tensors():
    master = torch.randn(5, 7) * torch.logspace(-30, 30, 7)
    param, remainder = torch.empty(5, 7, dtype=torch.bfloat16), torch.empty(5, 7, dtype=torch.int16)
    split_master_(master, param, remainder)
    expected = split_master(master)
    assert torch.equal(param.view(torch.int16), expected[0].view(torch.int16)) and torch.equal(remainder, expected[1])
    assert torch.equal(join_master(param, remainder).view(torch.int32), master.view(torch.int32))
    copy = torch.empty(5, 7, dtype=torch.bfloat16)
    round_ties_away_(master, copy)
    assert torch.equal(copy.view(torch.int16), param.view(torch.int16))
    view = torch.empty(7, 5, dtype=torch.bfloat16).T  # non-contiguous targets are written through their views
    rem_view = torch.empty(7, 5, dtype=torch.int16).T
    split_master_(master, view, rem_view)
    assert torch.equal(join_master(view, rem_view).view(torch.int32), master.view(torch.int32))


def test_wrong_dtypes_and_shapes_are_refused():
    with pytest.raises(ValueError, match="float32"):
        split_master(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int16 remainder"):
        join_master(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int16))
    with pytest.raises(ValueError, match="int16 remainder"):
        join_master(torch.zeros(3), torch.zeros(3, dtype=torch.int16))
    with pytest.raises(ValueError, match="differ in shape"):
        split_master_(torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int16))
    with pytest.raises(ValueError, match="bfloat16"):
        round_ties_away_(torch.zeros(3), torch.zeros(3))


def test_storage_options_from_the_precision_section():
    from v4launch.validators.schema.precision import PrecisionConfig

    default = PrecisionConfig()  # the recipe's defaults: today's optimizers, unchanged
    assert StorageOptions.from_precision(default) == StorageOptions(torch.float32, torch.float32, True)
    assert storage_for(default) is None
    new = PrecisionConfig(params_dtype="bf16", store_param_remainders=False, exp_avg_dtype="bf16",
                          exp_avg_sq_dtype="fp32")
    opts = StorageOptions.from_precision(new)
    assert opts == StorageOptions(torch.bfloat16, torch.float32, False) and opts.master_key == MASTER_PARAM
    assert storage_for(new) == opts
    assert StorageOptions().master_key == MASTER_REMAINDER
    assert storage_for(PrecisionConfig(exp_avg_sq_dtype="bf16")).exp_avg_sq_dtype == torch.bfloat16
    bad = SimpleNamespace(params_dtype="fp32", exp_avg_dtype="fp16", exp_avg_sq_dtype="fp32", store_param_remainders=True)
    with pytest.raises(ValueError, match=r"precision.exp_avg_dtype = 'fp16': choose one of fp32, bf16"):
        StorageOptions.from_precision(bad)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype"):
        StorageOptions(exp_avg_sq_dtype=torch.float16)


def test_state_dtypes_follow_the_parameter():
    opts = StorageOptions(torch.bfloat16, torch.bfloat16, True)
    fp32, bf16, fp64 = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64)
    assert opts.state_dtype("exp_avg", fp32) == torch.bfloat16
    assert opts.state_dtype("momentum_buffer", bf16) == torch.bfloat16
    assert opts.state_dtype("exp_avg_sq", fp64) == torch.float64  # other parameter dtypes keep their own
    assert opts.state_dtype(MASTER_REMAINDER, bf16) == torch.int16
    assert opts.state_dtype(MASTER_PARAM, bf16) == torch.float32
    assert opts.state_dtype("step", fp32) is None
