"""Token movement of the MoE without atomics (issue 17): the dispatch gather and the combine are
gathers both ways (model.moe.route_slots / gather_rows / combine_slots).

References: the former implementation (argsort, ``x[token_of]``, ``index_add`` of the weighted
outputs; autograd's own backward) in float64, and torch.autograd.gradcheck.
"""

from __future__ import annotations

import pytest
import torch

from v4_helpers import randomize, tiny_args
from v4launch.model.moe import MoE, _compute_dtype, combine_slots, gather_rows, route_slots, run_local_experts
from v4launch.model.moe import sequence_balance_loss


def _indices(T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] distinct experts per token, as top-k gives them."""
    return torch.rand(T, E, generator=gen).topk(K, dim=1).indices


@pytest.mark.parametrize("T", [0, 1, 13])
def test_route_matches_argsort_bincount_and_inverse(T, gen):
    K, E = 3, 7
    idx = _indices(T, K, E, gen)
    route = route_slots(idx, E)
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    assert torch.equal(route.order, order)
    assert torch.equal(route.token_of, order // K)
    assert torch.equal(route.counts, torch.bincount(flat, minlength=E))
    assert torch.equal(route.slot_to_sorted, order.argsort())


def test_dispatch_and_combine_equal_indexing_and_index_add_with_gradients(gen):
    T, K, E, d = 9, 2, 5, 4
    idx = _indices(T, K, E, gen)
    route = route_slots(idx, E)
    x = torch.randn(T, d, generator=gen, dtype=torch.float64, requires_grad=True)
    ys = torch.randn(T * K, d, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, generator=gen, dtype=torch.float64, requires_grad=True)
    g_xs, g_y = (torch.randn(T * K, d, generator=gen, dtype=torch.float64),
                 torch.randn(T, d, generator=gen, dtype=torch.float64))

    xs = gather_rows(x, route.token_of, route.slot_to_sorted, K)
    y = combine_slots(ys, route, w)
    new = torch.autograd.grad((xs * g_xs).sum() + (y * g_y).sum(), (x, ys, w))

    xs_ref = x[route.token_of]  # the former dispatch and combine
    ws = w.flatten()[route.order, None]
    y_ref = torch.zeros(T, d, dtype=torch.float64).index_add(0, route.token_of, ys * ws)
    ref = torch.autograd.grad((xs_ref * g_xs).sum() + (y_ref * g_y).sum(), (x, ys, w))

    torch.testing.assert_close(xs, xs_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, rtol=1e-14, atol=1e-14)
    for a, b, name in zip(new, ref, ("x", "ys", "weights")):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14, msg=name)


def test_gather_rows_and_combine_pass_gradcheck(gen):
    T, K, E, d = 5, 3, 4, 3
    route = route_slots(_indices(T, K, E, gen), E)
    x = torch.randn(T, d, generator=gen, dtype=torch.float64, requires_grad=True)
    ys = torch.randn(T * K, d, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, route.token_of, route.slot_to_sorted, K), (x,))
    assert torch.autograd.gradcheck(lambda a, b: combine_slots(a, route, b), (ys, w))


def _former_moe_forward(moe: MoE, x, token_ids, seg, n_segments):
    """MoE.forward as it was before the gathers (argsort, x[token_of], index_add)."""
    weights, indices, scores = moe.gate(x, token_ids)
    flat = indices.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(moe.n_experts, dtype=torch.int64).index_add_(0, flat, torch.ones_like(flat))
    token_of = order // moe.topk
    xs = x[token_of].to(_compute_dtype(x))
    ys = run_local_experts(list(moe.experts.values()), xs, counts)
    ws = weights.flatten()[order, None]
    y = torch.zeros(x.shape, dtype=x.dtype).index_add(0, token_of, ys * ws)
    y = y + moe.shared_experts(x)
    return y, sequence_balance_loss(scores, indices, seg, n_segments, moe.n_experts)


@pytest.mark.parametrize("layer_id", [0, 1])  # hash router, learned router
def test_moe_matches_the_former_implementation_in_float64(layer_id, gen):
    args = tiny_args()
    moe = MoE(layer_id, args).double()
    randomize(moe, gen)
    T = 17
    x = torch.randn(T, args.dim, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, args.vocab_size, (T,), generator=gen)
    seg = torch.tensor([0] * 10 + [1] * 7)
    g = torch.randn(T, args.dim, generator=gen, dtype=torch.float64)
    params = [x] + list(moe.parameters())

    def grads(fn):
        y, bal = fn(moe, x, tokens, seg, 2)
        return y.detach(), bal.detach(), torch.autograd.grad((y * g).sum() + bal, params, allow_unused=True)

    y, bal, new = grads(MoE.forward)
    y_ref, bal_ref, ref = grads(_former_moe_forward)
    torch.testing.assert_close(y, y_ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(bal, bal_ref, rtol=0, atol=0)
    for (name, _), a, b in zip([("x", x)] + list(moe.named_parameters()), new, ref):
        if b is None:
            assert a is None or not a.any(), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)
