"""Which parameters go to Muon and which to AdamW; FP32-pinned parameters and recorded dtypes."""

from __future__ import annotations

import re

import pytest
import torch

from v4launch.model import ModelArgs, V4Model
from v4launch.training.optim import Optimizers
from v4launch.validators.schema import OptimizerConfig

ARGS = ModelArgs(vocab_size=264, dim=32, n_layers=3, n_mtp_layers=1, compress_ratios=(0, 4, 128, 0), n_heads=2,
                 head_dim=32, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, window_size=16,
                 index_n_heads=2, index_head_dim=32, index_topk=4, n_routed_experts=4, n_activated_experts=2,
                 moe_inter_dim=32, n_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=3)

ADAMW = re.compile(r"(^embed\.weight$|^head\.weight$|norm\.weight$|(^|\.)hc_|\.ape$|\.attn_sink$|ffn\.gate\.weight$)")


def _where(opt: Optimizers, model) -> dict[str, str]:
    out = {}
    for group, info in opt.summary(model).items():
        for name in info["names"]:
            assert name not in out, f"{name} is in two groups"
            out[name] = group
    return out


@pytest.mark.parametrize("phase", ["dense", "warmup"])
def test_muon_gets_hidden_matrices_and_adamw_the_rest(phase):
    model = V4Model(ARGS, phase=phase)
    opt = Optimizers(model, OptimizerConfig(name="muon_adamw"))
    where = _where(opt, model)
    assert set(where) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        kind = where[name].split("/")[0]
        if ADAMW.search(name) or p.ndim != 2:
            assert kind.startswith("adamw"), name
        else:
            assert kind == "muon", name
        assert where[name].endswith("/indexer") == (".indexer." in name), name
    assert isinstance(opt.muon, torch.optim.Muon) and isinstance(opt.adamw, torch.optim.AdamW)
    no_decay = [n for n, g in where.items() if g.startswith("adamw_no_decay")]
    assert all(ADAMW.search(n) and not n.endswith(("embed.weight", "head.weight", "gate.weight")) for n in no_decay)


def test_adamw_recipe_puts_everything_in_adamw():
    model = V4Model(ARGS, phase="warmup")
    opt = Optimizers(model, OptimizerConfig(name="adamw"))
    assert opt.muon is None
    assert all(not g.startswith("muon") for g in _where(opt, model).values())


def test_phase_change_adds_indexer_groups_after_the_base_groups():
    model = V4Model(ARGS, phase="dense")
    opt = Optimizers(model, OptimizerConfig())
    before = [g["name"] for g in opt.param_groups]
    seen = {n for n, _ in model.named_parameters()}
    model.set_phase("warmup")
    opt.add_params(model, [(n, p) for n, p in model.named_parameters() if n not in seen], "indexer")
    fresh = Optimizers(V4Model(ARGS, phase="warmup"), OptimizerConfig())
    assert [g["name"] for g in opt.param_groups] == [g["name"] for g in fresh.param_groups]
    assert set(before) < {g["name"] for g in opt.param_groups}
    assert any(g["name"].endswith("/indexer") for g in opt.param_groups)


def test_pinned_fp32_parameters_stay_fp32_and_are_recorded_per_group():
    model = V4Model(ARGS, phase="warmup").to(torch.bfloat16)
    pinned = [n for n, p in model.named_parameters() if re.search(r"(\.ape$|\.attn_sink$|(^|\.)hc_)", n)]
    assert pinned
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if name in pinned else torch.bfloat16), name
    summary = Optimizers(model, OptimizerConfig()).summary(model)
    assert set(summary["adamw_no_decay/base"]["dtypes"]) == {"bfloat16", "float32"}  # norms bf16, mHC/sink fp32
    assert set(summary["muon/base"]["dtypes"]) == {"bfloat16"}


# ------------------------------------------------------------------ Muon (v4launch.training.muon)
MUON_SHAPES = [(7, 5), (5, 7), (6, 6), (1, 4), (9, 2)]
MUON_GROUPS = [dict(nesterov=True, adjust_lr_fn=None, weight_decay=0.1),
               dict(nesterov=False, adjust_lr_fn="match_rms_adamw", weight_decay=0.0, momentum=0.9)]


def _seeded() -> torch.Generator:
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    print(f"generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


def _muon_params(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in MUON_SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    half = len(params) // 2
    return [dict(params=params[:half], **MUON_GROUPS[0]), dict(params=params[half:], **MUON_GROUPS[1])]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def test_muon_equals_torch_muon_on_plain_parameters():
    """float64 parameters, bf16 Newton-Schulz (torch's), several steps, both nesterov settings and lr rules."""
    from v4launch.training.muon import Muon

    gen = _seeded()
    init = _muon_params(gen)
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in MUON_SHAPES] for _ in range(4)]
    ours = [p.clone().requires_grad_() for p in init]
    theirs = [p.clone().requires_grad_() for p in init]
    a, b = Muon(_groups(ours), lr=0.05), torch.optim.Muon(_groups(theirs), lr=0.05)
    _run(a, ours, grads)
    _run(b, theirs, grads)
    for p, q in zip(ours, theirs):
        assert (p - q).abs().max().item() <= 1e-12
        assert (a.state[p]["momentum_buffer"] - b.state[q]["momentum_buffer"]).abs().max().item() <= 1e-12
    assert a.state_dict()["param_groups"] == b.state_dict()["param_groups"]  # same keys: checkpoints interchange


def _reference_muon_step(w, g, buf, lr, group, coefficients=(3.4445, -4.7750, 2.0315), steps=5):
    """Muon written out from its definition, float64, with the Newton-Schulz iterate kept TALL where the matrix
    is tall (X <- aX + b X(X^T X) + c X(X^T X)^2, the same polynomial from the other side)."""
    mu = group.get("momentum", 0.95)
    buf = mu * buf + (1 - mu) * g
    u = (1 - mu) * g + mu * buf if group["nesterov"] else buf
    x = u / max(u.norm().item(), 1e-7)
    for _ in range(steps):
        if x.shape[0] > x.shape[1]:
            gram = x.T @ x
            x = coefficients[0] * x + coefficients[1] * x @ gram + coefficients[2] * x @ gram @ gram
        else:
            gram = x @ x.T
            x = coefficients[0] * x + coefficients[1] * gram @ x + coefficients[2] * gram @ gram @ x
    rows, cols = w.shape
    scale = 0.2 * max(rows, cols) ** 0.5 if group["adjust_lr_fn"] == "match_rms_adamw" else max(1, rows / cols) ** 0.5
    return w * (1 - lr * group["weight_decay"]) - lr * scale * x, buf


def test_muon_in_float64_matches_its_definition():
    """ns_dtype float64 against an independent float64 write-up of the algorithm, over several steps."""
    from v4launch.training.muon import Muon

    gen = _seeded()
    init = _muon_params(gen)
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in MUON_SHAPES] for _ in range(3)]
    ours = [p.clone().requires_grad_() for p in init]
    _run(Muon(_groups(ours), lr=0.05, ns_dtype=torch.float64), ours, grads)
    half = len(init) // 2
    for i, w in enumerate(init):
        buf = torch.zeros_like(w)
        for step_grads in grads:
            w, buf = _reference_muon_step(w, step_grads[i], buf, 0.05, MUON_GROUPS[0 if i < half else 1])
        assert (ours[i].detach() - w).abs().max().item() <= 1e-12, (i, MUON_SHAPES[i])


def test_muon_rejects_what_torch_muon_rejects():
    from v4launch.training.muon import Muon

    with pytest.raises(ValueError, match="2D"):
        Muon([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match="ns_steps=100"):
        Muon([torch.zeros(2, 2, requires_grad=True)], ns_steps=100)


def test_same_shape_matrices_are_orthogonalised_as_one_stack_with_each_its_own_result(monkeypatch):
    """Experts share shapes: their Newton-Schulz runs as one batched iteration (baddbmm), and each matrix's
    step still equals Muon's definition (float64, several steps, tall and wide stacks, a size-1 stack)."""
    from v4launch.training.muon import Muon

    gen = _seeded()
    shapes = [(6, 4)] * 4 + [(3, 8)] * 3 + [(5, 5)]
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(3)]
    ours = [p.clone().requires_grad_() for p in init]
    calls = []
    baddbmm = torch.baddbmm
    monkeypatch.setattr(torch, "baddbmm", lambda *a, **k: calls.append(a[1].shape[0]) or baddbmm(*a, **k))
    group = MUON_GROUPS[0]
    _run(Muon([dict(params=ours, **group)], lr=0.05, ns_dtype=torch.float64), ours, grads)
    assert sorted(set(calls)) == [3, 4], "one stack per shape with more than one matrix"
    for i, w in enumerate(init):
        buf = torch.zeros_like(w)
        for step_grads in grads:
            w, buf = _reference_muon_step(w, step_grads[i], buf, 0.05, group)
        assert (ours[i].detach() - w).abs().max().item() <= 1e-12, (i, shapes[i])


def test_stacks_are_bounded_and_give_the_unstacked_result():
    """A stack cap of one matrix (no batching) and the default give the same parameters (bf16 Newton-Schulz)."""
    from v4launch.training.muon import Muon

    gen = _seeded()
    shapes = [(16, 8)] * 5
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(2)]
    a_params, b_params = [p.clone().requires_grad_() for p in init], [p.clone().requires_grad_() for p in init]
    a, b = Muon([dict(params=a_params)], lr=0.05), Muon([dict(params=b_params)], lr=0.05)
    b.stack_elements = 1  # flush after every matrix: each runs alone
    _run(a, a_params, grads)
    _run(b, b_params, grads)
    for p, q in zip(a_params, b_params):
        assert (p - q).abs().max().item() <= 2e-2 * 0.05  # bf16 GEMMs batched vs single: within bf16 rounding of lr*O
