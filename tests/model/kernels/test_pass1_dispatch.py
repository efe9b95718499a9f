"""Which pass-1 kernel the two-pass backward runs (``triton_attention_bwd.attention_bwd``'s
``dkv_kernel``): the choice is checked and explained on any machine, without a GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_two_pass_backward_pass1_kernel_choice_is_checked():
    """``dkv_kernel`` names a pass-1 kernel; an unknown name, or the Gluon kernel where it cannot run
    (here: a CPU tensor, and D = 64), is refused with the reason instead of silently switching."""
    import torch

    from v4launch.model.kernels import triton_attention_bwd as tb

    q = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dkv_kernel='cuda'.*'auto', 'gluon' or 'triton'"):
        tb.attention_bwd(q, q[:, 0], None, None, q, torch.zeros(2, 64), q, 1.0, dkv_kernel="cuda")
    with pytest.raises(ValueError, match="dkv_kernel='gluon' needs an SM90 GPU"):
        tb.attention_bwd(q, q[:, 0], None, None, q, torch.zeros(2, 64), q, 1.0, dkv_kernel="gluon")
    assert "SM90" in tb.gluon_pass1_unavailable(q)


def test_auto_takes_the_gluon_pass1_only_on_a_tested_triton(monkeypatch):
    """On an SM90 GPU with D = 512, "auto" still takes the Triton pass 1 on a Triton release the
    Gluon kernel was not tested with (Gluon's API moves between releases), and says so; asking for
    it by name skips only that check."""
    from types import SimpleNamespace

    import torch
    import triton

    from v4launch.model.kernels import triton_attention_bwd as tb

    q = SimpleNamespace(shape=(8, 64, 512), is_cuda=True, device="cuda:0", dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton, "__version__", "3.99.0")
    why_auto, why_named = tb.gluon_pass1_unavailable(q), tb.gluon_pass1_unavailable(q, explicit=True)
    if why_named is not None:  # this machine's Triton cannot import the kernel at all
        assert "no Gluon" in why_named and why_auto == why_named
    else:
        assert "tested with Triton 3.6.x, this is 3.99.0" in why_auto
    monkeypatch.setattr(triton, "__version__", tb.GLUON_TESTED_TRITON[0] + "1")
    assert tb.gluon_pass1_unavailable(q) == why_named


def test_gluon_pass1_needs_128_row_tiles(monkeypatch):
    """The sweep may set 64-row pass-1 tiles; the Gluon kernel is built for 128 (8 warps x 16 rows),
    so it is then not taken, with the reason."""
    from types import SimpleNamespace

    import torch

    from v4launch.model.kernels import triton_attention_bwd as tb

    q = SimpleNamespace(shape=(8, 64, 512), is_cuda=True, device="cuda:0", dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(tb.CONFIGS, "dkv", dict(tb.CONFIGS["dkv"], BN=64))
    assert "128 kv rows" in tb.gluon_pass1_unavailable(q, explicit=True)
