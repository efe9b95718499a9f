"""Sparse mode memory grows linearly in tokens: no [T, T] or dense [T, H, entries] tensor is kept.

Two measurements at three lengths with a fixed chunk size: the largest tensor any
operator produces (a dispatch mode), and the bytes autograd saves for backward
(saved-tensor hooks, deduplicated by storage).
"""

from __future__ import annotations

import torch

from v4_helpers import LargestTensor, build, packed_batch, tiny_args


def _measure(model, T, gen):
    batch = packed_batch([T], model.args.vocab_size, gen)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), LargestTensor() as mode:
        out = model(*batch)
    out.lm_loss.backward()
    return mode.largest, sum(storages.values())


def test_sparse_mode_memory_is_linear_in_tokens(gen):
    args = tiny_args(vocab_size=32, window_size=16, index_topk=4)
    model = build(args, "sparse", gen, dtype=torch.float32, chunk_size=64)
    sizes = [_measure(model, T, gen) for T in (512, 1024, 2048)]
    for (big_a, saved_a), (big_b, saved_b) in zip(sizes, sizes[1:]):
        assert big_b / big_a < 2.3, sizes  # quadratic would be ~4x per doubling
        assert saved_b / saved_a < 2.3, sizes


def test_measurement_sees_quadratic_dense_teacher(gen):
    """Control: without chunk recomputation the warm-up student scores over all visible
    entries ([R, entries] per chunk) are kept for backward: quadratic in what is saved."""
    args = tiny_args(vocab_size=32, window_size=16, index_topk=4, n_layers=2, n_mtp_layers=0,
                     compress_ratios=(4, 4), n_hash_layers=0)
    model = build(args, "warmup", gen, dtype=torch.float32, chunk_size=64, recompute=False)
    (_, a), (_, b) = (_measure(model, T, gen) for T in (1024, 2048))
    assert b / a > 2.5


def test_warmup_with_recompute_saves_linear_memory(gen):
    """The default recomputes each chunk in backward: the warm-up saves O(T) bytes too."""
    args = tiny_args(vocab_size=32, window_size=16, index_topk=4, n_layers=2, n_mtp_layers=0,
                     compress_ratios=(4, 4), n_hash_layers=0)
    model = build(args, "warmup", gen, dtype=torch.float32, chunk_size=64)
    (_, a), (_, b) = (_measure(model, T, gen) for T in (1024, 2048))
    assert b / a < 2.3


def test_recompute_changes_no_number(gen):
    """Chunk recomputation is exact: loss and every gradient equal the kept-activation run."""
    args = tiny_args(vocab_size=32, window_size=16, index_topk=4)
    batch = packed_batch([300, 212], args.vocab_size, gen)
    grads = []
    for recompute in (False, True):
        model = build(args, "sparse", torch.Generator().manual_seed(7), chunk_size=64, recompute=recompute)
        out = model(*batch)
        (out.lm_loss + sum(out.aux_losses.values())).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0, msg=name)
