"""Harness for the pipeline tests: spawn gloo ranks laid out as docs/parallelism.md's rank grid, run one
or more optimizer steps through the pipeline and the same steps on one process, compare.

rank = pp_rank · S + dp_rank · cp + cp_rank with S = dp · cp. Every rank builds the same seeded float64
model and the same micro-batches (fresh per case seed), runs the single-process reference itself (every
micro-batch whole, ``(lm + Σ w·aux) / accum`` backpropagated per micro-batch, as the job's step), then the
pipeline (pp ranks × its CP slice), reduces gradients over its S group (sum over CP, mean over DP) and
reports the worst relative error of every parameter gradient it holds, of every loss it computed, and the
names it covered. A uniquely named module so no conftest shadows it.
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/model (v4_helpers)

from v4_helpers import build, gloo_spawn, packed_batch, tiny_args  # noqa: E402

from v4launch.model.parallel import ContextParallelGroup, shard_thd_batch  # noqa: E402
from v4launch.model.parallel.pipeline import PipelineParallel, cut_stage, local_specs, stage_specs  # noqa: E402
from v4launch.training.step import LossWeights, compose_loss  # noqa: E402

WEIGHTS = LossWeights(indexer_kl=0.7, balance=0.3, mtp=0.5)  # distinct, so a misrouted weight shows


@dataclass
class MB:
    tokens: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def spawn(world: int, cases: list[dict], tmp_path) -> list[list[dict]]:
    """Run ``cases`` on ``world`` gloo ranks; returns results[rank][case index]."""
    return gloo_spawn(world, cases, tmp_path, run_case)


def run_case(case: dict) -> dict:
    """One case on this rank (dispatched by its contents)."""
    return pipeline_case(case)


def _groups(pp: int, dp: int, cp: int):
    """(pipeline group, CP hooks, S group) of this rank; every rank creates every group in the same order."""
    rank, S = dist.get_rank(), dp * cp
    mine = {}
    for j in range(S):
        g = dist.new_group([p * S + j for p in range(pp)])
        if rank % S == j:
            mine["pipe"] = g
    for p in range(pp):
        g = dist.new_group(list(range(p * S, (p + 1) * S)))
        if rank // S == p:
            mine["s"] = g
        for d in range(dp):
            ranks = [p * S + d * cp + c for c in range(cp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["cp"] = g
    return mine["pipe"], (ContextParallelGroup(mine["cp"]) if cp > 1 else None), mine["s"]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) if b.numel() else 0.0


def _batches(case: dict, args, gen: torch.Generator, dp: int) -> list[list[MB]]:
    """batches[d]: the micro-batches of DP replica d (whole, not CP-sliced)."""
    out = []
    for _ in range(dp):
        mbs = []
        for lengths in case["lengths"]:
            tokens, cu, max_len, labels = packed_batch(lengths, args.vocab_size, gen)
            mbs.append(MB(tokens, labels, cu, max_len))
        out.append(mbs)
    return out


def _slice(mb: MB, cp: int, cp_rank: int) -> tuple:
    """This CP rank's rows of ``mb`` (tokens, labels) with the global cu_seqlens and max_seqlen."""
    if cp == 1:
        return mb.tokens, mb.labels, mb.cu_seqlens, mb.max_seqlen
    sl = shard_thd_batch(mb.tokens, mb.labels, mb.cu_seqlens, cp_rank, cp)
    return sl.tokens, sl.labels, mb.cu_seqlens, mb.max_seqlen


def _reference_step(model, batches: list[list[MB]], opt) -> dict[str, float]:
    """Single process: every DP replica's micro-batches, gradients averaged over replicas; raw loss sums."""
    sums: dict[str, float] = {}
    dp, accum = len(batches), len(batches[0])
    for mbs in batches:
        for mb in mbs:
            out = model(mb.tokens, mb.cu_seqlens, mb.max_seqlen, mb.labels)
            ((compose_loss(out.lm_loss, out.aux_losses, WEIGHTS) / accum) / dp).backward()
            for name, v in (("lm_loss", out.lm_loss), *out.aux_losses.items()):
                sums[name] = sums.get(name, 0.0) + float(v.detach()) / dp
    if opt is not None:
        opt.step()
    return sums


def pipeline_case(case: dict) -> dict:
    """One case: ``pp``, ``vpp``, ``layout``, ``cp``, ``dp``, ``phase``, ``lengths`` (one list per
    micro-batch, same total), ``seed``, ``steps`` (optimizer steps; 1 = gradients only)."""
    pp, vpp, cp, dp = case["pp"], case.get("vpp", 1), case.get("cp", 1), case.get("dp", 1)
    steps = case.get("steps", 1)
    args = tiny_args(**case.get("args", {}))
    gen = torch.Generator().manual_seed(case["seed"])
    full = build(args, case["phase"], gen, chunk_size=32)
    ref = copy.deepcopy(full)
    pipe_group, cp_hooks, s_group = _groups(pp, dp, cp)
    rank, S = dist.get_rank(), dp * cp
    pp_rank, (dp_rank, cp_rank) = rank // S, divmod(rank % S, cp)
    specs = local_specs(stage_specs(case["layout"], pp, vpp, args.n_layers, args.n_mtp_layers), pp_rank)
    parts = [cut_stage(full, s) for s in specs]
    for part in parts:
        part.cp = cp_hooks or part.cp
    del full
    pipe = PipelineParallel(parts, specs, pipe_group, torch.device("cpu"), torch.float64)
    mine = {n: p for part in parts for n, p in part.named_parameters()}
    make_opt = (lambda ps: torch.optim.AdamW(ps, lr=1e-3)) if steps > 1 else (lambda ps: None)
    ref_opt, opt = make_opt(ref.parameters()), make_opt(list(mine.values()))
    worst_g, worst_name, loss_err = 0.0, "", 0.0
    for _ in range(steps):
        batches = _batches(case, args, gen, dp)
        ref.zero_grad(set_to_none=True)
        ref_sums = _reference_step(ref, batches, None)
        local = [MB(*_slice(mb, cp, cp_rank)) for mb in batches[dp_rank]]
        for p in mine.values():
            p.grad = None
        sums = pipe.step(local, (lambda n: 1.01 * WEIGHTS.of(n)) if case.get("control") else WEIGHTS.of)
        vals = torch.tensor([sums[k] for k in sorted(sums)], dtype=torch.float64)
        dist.all_reduce(vals, group=s_group)  # mean over DP (CP ranks hold the same global losses)
        for k, v in zip(sorted(sums), (vals / S).tolist()):
            loss_err = max(loss_err, abs(v - ref_sums[k]) / max(abs(ref_sums[k]), 1e-30))
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for name, p in mine.items():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=s_group)
            g /= dp
            r = ref_grads[name] if ref_grads[name] is not None else torch.zeros_like(p)
            p.grad = g
            e = _err(g, r)
            if e >= worst_g:
                worst_g, worst_name = e, name
        if steps > 1:
            ref_opt.step()
            opt.step()
    eval_err = None
    if case.get("eval"):  # held-out loss through the forward-only schedule, on fresh batches
        batches = _batches(dict(lengths=case["lengths"][:case["eval"]]), args, gen, 1)[0]
        ref.eval()
        with torch.no_grad():
            want = sum(float(ref(mb.tokens, mb.cu_seqlens, mb.max_seqlen, mb.labels).lm_loss) for mb in batches)
        for part in parts:
            part.eval()
        local = [MB(*_slice(mb, cp, cp_rank)) for mb in batches]
        got = pipe.evaluate(local)
        eval_err = abs(got["lm_loss"] - want) / abs(want) if "lm_loss" in got else None
    ref_params = dict(ref.named_parameters())
    param_err = max(_err(p.detach(), ref_params[n].detach()) for n, p in mine.items())
    return dict(grad=worst_g, worst=worst_name, loss=loss_err, loss_names=sorted(sums), params=sorted(mine),
                all_params=sorted(ref_params), all_losses=sorted(ref_sums), param_err=param_err, eval=eval_err)
