"""Constants pinned directly (seed 004 items 1, 2, 3, 6a, 8): a parity test cannot see a constant
that a shared reference gets wrong the same way."""

from __future__ import annotations

import math

import torch

from v4_helpers import randomize, tiny_args
from v4launch.model import ModelArgs
from v4launch.model.attention import Attention, BatchContext
from v4launch.model.compressor import Compressor, hadamard_matrix
from v4launch.model.indexer import Indexer
from v4launch.model.packing import compress_plan, make_pack
from v4launch.model.rope import RotaryEmbedding, apply_rope, yarn_inv_freq


def test_indexer_temperature_and_softmax_scale():
    flash = ModelArgs()
    idx = Indexer(flash.replace(dim=8, q_lora_rank=8, vocab_size=8))
    assert idx.weight_scale == 64 ** -0.5 * 128 ** -0.5  # ~1/90.5
    attn = Attention(3, tiny_args(head_dim=16, compress_ratios=(0, 4, 128, 128, 0)), with_indexer=False)
    assert attn.softmax_scale == 16 ** -0.5  # no YaRN mscale on compressed layers


def test_flash_yarn_ramp_and_per_layer_rope():
    args = ModelArgs()
    base = 1.0 / 160000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    f = yarn_inv_freq(64, 160000.0, 16.0, 65536, 32, 1)
    assert torch.equal(f[:16], base[:16])  # pairs 0..15 untouched
    assert torch.allclose(f[25:], base[25:] / 16)  # pairs 25.. fully interpolated
    assert ((f[16:25] < base[16:25]) & (f[16:25] > base[16:25] / 16)).all()
    swa, csa = RotaryEmbedding(args, 0), RotaryEmbedding(args, 4)
    assert torch.allclose(swa.inv_freq, 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert torch.equal(csa.inv_freq, f)


def test_compressed_entries_rotate_at_i_times_ratio(gen):
    """Entry i sits at position i * ratio; with 3 entries the i and i*ratio conventions differ."""
    args = tiny_args()
    comp = Compressor(args.dim, 16, 4, args.norm_eps).double()
    randomize(comp, gen)
    x = torch.randn(13, args.dim, generator=gen, dtype=torch.float64)
    pack = make_pack(torch.zeros(13, dtype=torch.long), torch.tensor([0, 13]), 13)
    plan = compress_plan(pack, 4)
    rope = RotaryEmbedding(args, 4)
    out = comp(x, plan, rope)
    assert out.shape == (3, 16) and plan.pos.tolist() == [0, 4, 8]
    cos, sin = rope.cos_sin(torch.tensor([0, 4, 8]), torch.float64)
    unrotated = apply_rope(out, cos, sin, inverse=True)
    cos_i, sin_i = rope.cos_sin(torch.tensor([0, 1, 2]), torch.float64)
    assert not torch.allclose(apply_rope(unrotated, cos_i, sin_i), out)  # the conventions really differ here
    # derotated entries no longer depend on position: the nope part equals the rope-free pooled entry
    comp_rope_free = RotaryEmbedding(args, 4)
    comp_rope_free.inv_freq = torch.zeros_like(comp_rope_free.inv_freq)
    assert torch.allclose(comp(x, plan, comp_rope_free), unrotated, atol=1e-12)


def test_inverse_rope_is_the_inverse_and_is_out_of_place(gen):
    rope = RotaryEmbedding(tiny_args(), 4)
    x = torch.randn(5, 3, 16, generator=gen, dtype=torch.float64)
    keep = x.clone()
    cos, sin = rope.cos_sin(torch.arange(5) * 37, torch.float64)
    y = apply_rope(x, cos, sin)
    assert torch.equal(x, keep) and not torch.allclose(y[..., -8:], x[..., -8:])
    assert torch.equal(y[..., :8], x[..., :8])  # only the last rope_head_dim channels rotate
    assert torch.allclose(apply_rope(y, cos, sin, inverse=True), x, atol=1e-14)
    # interleaved pairs: channel pair (2i, 2i+1) is one complex number
    z = torch.view_as_complex(x[..., -8:].reshape(5, 3, 4, 2).contiguous())
    ang = (torch.arange(5) * 37)[:, None, None].double() * rope.inv_freq
    expect = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).reshape(5, 3, 8)
    assert torch.allclose(y[..., -8:], expect, atol=1e-14)


def test_attention_output_is_derotated_before_wo_a(gen):
    """Window 1 and a -inf sink: each query reads only its own KV, rotated at its position.
    After de-rotation the output must equal the UNROTATED latent for every layer kind."""
    for layer_id in (0, 1, 2):
        args = tiny_args(window_size=1)
        attn = Attention(layer_id, args, with_indexer=False).double()
        randomize(attn, gen)
        with torch.no_grad():
            attn.attn_sink.fill_(-1e4)
        T = 7  # < 128 and < 2*4 entries visible to few rows; rows 0..2 see no compressed entry
        x = torch.randn(T, args.dim, generator=gen, dtype=torch.float64)
        ctx = BatchContext(make_pack(torch.zeros(T, dtype=torch.long), torch.tensor([0, T]), T), 1)
        out, _ = attn(x, ctx)
        kv = attn.kv_norm(x @ attn.wkv.weight.T)  # [T, D] unrotated latent
        o = kv[:, None, :].expand(T, args.n_heads, args.head_dim).reshape(T, args.o_groups, -1)
        wo_a = attn.wo_a.weight.view(args.o_groups, args.o_lora_rank, -1)
        expect = torch.einsum("tgd,grd->tgr", o, wo_a).flatten(1) @ attn.wo_b.weight.T
        rows = slice(0, 3)  # rows with no compressed entry visible (pos + 1 < 4)
        assert torch.allclose(out[rows], expect[rows], atol=1e-12), layer_id


def test_hadamard_is_orthogonal_and_symmetric():
    h = hadamard_matrix(16, torch.float64, torch.device("cpu"))
    assert torch.allclose(h @ h.T, torch.eye(16, dtype=torch.float64), atol=1e-14)
    assert torch.equal(h, h.T) and abs(h[0, 0].item() - 0.25) < 1e-15
