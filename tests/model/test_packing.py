"""THD packing: packed forward == per-segment forwards; bad input raises a ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import build, packed_batch, tiny_args
from v4launch.model import V4Model
from v4launch.model.packing import compress_plan, make_pack, shift_in_segment, visible_table, window_table


@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
def test_packed_equals_per_segment(phase, gen):
    args = tiny_args()
    model = build(args, phase, gen, chunk_size=40)
    lengths = [1, 131, 3, 6, 130, 2]  # one token, tails < 4, HCA tails < 128, ragged
    tokens, cu, max_len, labels = packed_batch(lengths, args.vocab_size, gen)
    with torch.no_grad():
        packed = model(tokens, cu, max_len, labels, return_logits=True)
        kl_weighted, rows = {}, {}
        for b, L in enumerate(lengths):
            s, e = int(cu[b]), int(cu[b + 1])
            single = model(tokens[s:e], torch.tensor([0, L]), L, labels[s:e], return_logits=True)
            assert (packed.logits[s:e] - single.logits).abs().max().item() <= 1e-10
            for name, val in single.aux_losses.items():
                if name.startswith("balance/"):  # per-segment losses averaged over segments
                    kl_weighted[name] = kl_weighted.get(name, 0.0) + val.item() / len(lengths)
        for name, val in kl_weighted.items():
            assert abs(packed.aux_losses[name].item() - val) <= 1e-10


def test_tables_reset_at_boundaries():
    tokens = torch.zeros(11, dtype=torch.long)
    pack = make_pack(tokens, torch.tensor([0, 1, 10, 11]), 9)
    assert pack.pos.tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    idx, valid = window_table(pack, 3)
    assert idx[3].tolist() == [1, 2, 3] and valid[3].all()
    assert valid[1].tolist() == [False, False, True] and idx[1, 2].item() == 1
    plan = compress_plan(pack, 4)
    assert plan.n_entries == 2 and plan.start.tolist() == [1, 5] and plan.pos.tolist() == [0, 4]
    assert plan.n_visible.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 0]  # i < (pos + 1) // 4
    vidx, vvalid = visible_table(pack, plan)
    assert vidx[9].tolist() == [0, 1] and vvalid[9].all() and not vvalid[10].any()
    x = torch.arange(11)
    assert shift_in_segment(x, pack, -100).tolist() == [-100, 2, 3, 4, 5, 6, 7, 8, 9, -100, -100]


def _model():
    return V4Model(tiny_args(), "dense")


@pytest.mark.parametrize("cu,max_len,needle", [
    (torch.tensor([1, 5]), 5, "cu_seqlens"),  # does not start at 0
    (torch.tensor([0, 4]), 5, "cu_seqlens"),  # does not end at T
    (torch.tensor([0, 3, 3, 5]), 5, "strictly increasing"),
    (torch.tensor([0.0, 5.0]), 5, "cu_seqlens"),  # float
    (torch.tensor([0, 5]), 3, "max_seqlen"),
])
def test_bad_cu_seqlens(cu, max_len, needle):
    with pytest.raises(ValueError, match=needle) as err:
        _model()(torch.zeros(5, dtype=torch.long), cu, max_len)
    assert "Fix:" in str(err.value)


def test_bad_tokens_labels_and_phase():
    m = _model()
    with pytest.raises(ValueError, match="tokens"):
        m(torch.zeros(1, 5, dtype=torch.long), torch.tensor([0, 5]), 5)
    with pytest.raises(ValueError, match="labels"):
        m(torch.zeros(5, dtype=torch.long), torch.tensor([0, 5]), 5, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels=value 99"):
        m(torch.zeros(5, dtype=torch.long), torch.tensor([0, 5]), 5, torch.full((5,), 99))
    with pytest.raises(ValueError, match="tokens=range"):
        m(torch.full((5,), 61), torch.tensor([0, 5]), 5)
    with pytest.raises(ValueError, match="phase='spars'"):
        V4Model(tiny_args(), "spars")
    with pytest.raises(ValueError, match="phase='bogus'"):
        m.set_phase("bogus")
