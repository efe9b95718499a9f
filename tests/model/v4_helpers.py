"""Helpers for the model tests: tiny V4-shaped args, random parameters, packed batches.

A uniquely named module (not ``conftest``) so other test folders' conftest modules never shadow it."""

from __future__ import annotations

import json
import os
import sys

from unittest.mock import patch

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from v4launch.model import ModelArgs, V4Model
from v4launch.model import attention as attention_module
from v4launch.model.indexer import Indexer, select_topk


class LargestTensor(TorchDispatchMode):
    """A dispatch mode recording ``largest``: the most elements of any tensor an operator returned inside it."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def tiny_args(**changes) -> ModelArgs:
    """4 decoder layers (hash+SWA, CSA, HCA, CSA) + 1 MTP layer (SWA), every feature on."""
    base = dict(vocab_size=61, dim=32, n_layers=4, n_mtp_layers=1, compress_ratios=(0, 4, 128, 4, 0),
                n_heads=4, head_dim=16, rope_head_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=12,
                window_size=8, index_n_heads=8, index_head_dim=16, index_topk=3, use_hadamard=True,
                original_seq_len=64, rope_factor=4.0, n_routed_experts=4, n_activated_experts=2,
                n_shared_experts=1, moe_inter_dim=24, route_scale=1.5, n_hash_layers=1, swiglu_limit=1.5,
                hc_mult=2, hc_sinkhorn_iters=20, init_std=0.2)
    base.update(changes)
    return ModelArgs(**base)


@torch.no_grad()
def randomize(module: torch.nn.Module, gen: torch.Generator, std: float = 0.3) -> None:
    """Draw every floating parameter/buffer at random (norm weights around 1, biases small)."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if not t.is_floating_point():
            continue
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
        leaf = name.rsplit(".", 1)[-1]
        if ("norm." in name and leaf == "weight") or leaf.endswith("_scale"):
            t.copy_(1 + 0.2 * noise)
        elif leaf in ("bias", "attn_sink") or leaf.endswith("_base"):
            t.copy_(0.5 * noise)
        elif leaf == "ape":
            t.copy_(noise)
        else:
            t.copy_(std * noise)


def packed_batch(lengths, vocab: int, gen: torch.Generator):
    """tokens [T], cu_seqlens int32 [N+1], max_seqlen, labels [T] (next token, -100 at segment ends)."""
    T = sum(lengths)
    tokens = torch.randint(0, vocab, (T,), generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    labels = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
    labels[cu[1:].long() - 1] = -100
    return tokens, cu, max(lengths), labels


def fresh_gen() -> torch.Generator:
    """A generator with a fresh random seed (printed on failure through the test id)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    print(f"generator seed: {seed}")  # shown by pytest when the test fails
    return torch.Generator().manual_seed(seed)


def build(args: ModelArgs, phase: str, gen: torch.Generator, dtype=torch.float64, **kw) -> V4Model:
    model = V4Model(args, phase, **kw).to(dtype)
    randomize(model, gen)
    return model


def gloo_spawn(world: int, cases: list[dict], tmp_path, run_case) -> list[list[dict]]:
    """Run ``run_case(case)`` for every case on ``world`` gloo ranks (one thread each, a file store in
    ``tmp_path``); returns results[rank][case index] (each result JSON-serialisable).

    ``run_case`` must be a module-level function (the ranks are spawned processes that import it).
    Raises: whatever a rank raised, as ``torch.multiprocessing.ProcessRaisedException``.
    """
    import torch.multiprocessing as mp

    mp.spawn(_gloo_entry, args=(world, str(tmp_path), cases, run_case), nprocs=world, join=True)
    out = []
    for rank in range(world):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            out.append(json.load(f))
    return out


def _gloo_entry(rank: int, world: int, tmp: str, cases: list[dict], run_case) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        results = [run_case(case) for case in cases]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # The results are on disk: leave without interpreter teardown. Under load a gloo worker thread can
    # still be joinable when C++ statics are destroyed, and std::terminate then aborts a rank whose work
    # is done (seen once in three full runs on 2 cores: "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def boundary_ties(model: V4Model, batch) -> int:
    """Query rows whose k-th and (k+1)-th indexer scores are equal, in a forward of ``model``.

    The indexer's score is a weighted sum of ReLUs, so a row can hold several entries scoring exactly 0;
    where such a tie straddles the top-k boundary, either choice is a correct selection, and two devices'
    ``topk`` may choose differently (seen on an H200: logits 0.29 apart)."""
    ties = 0

    def counting(inp, vis_idx, vis_valid, rows, topk, lo, hi):
        nonlocal ties
        with torch.no_grad():
            s = Indexer.score_all(inp, rows, lo, hi).gather(1, vis_idx).masked_fill(~vis_valid, float("-inf"))
            k = min(topk, s.shape[1])
            if s.shape[1] > k:
                top = s.topk(k + 1, dim=1).values
                ties += int(((top[:, k - 1] == top[:, k]) & torch.isfinite(top[:, k])).sum())
        return select_topk(inp, vis_idx, vis_valid, rows, topk, lo, hi)

    with patch.object(attention_module, "select_topk", counting), torch.no_grad():
        model(*batch)
    return ties
