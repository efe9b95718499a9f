"""Optimizer construction: Muon for 2-D hidden matrices, AdamW for everything else.

Spec: reference/v4-model-spec.md §3 "Other training facts" — Muon for most weights;
AdamW for the embedding, the head, RMSNorm weights and the mHC static biases/gates.
This file's table (``adamw_reason``) is the single source of which parameter goes where:

=====================================  =========  =============================================
parameter (released names)             optimizer  why
=====================================  =========  =============================================
``embed.weight``, ``head.weight``      AdamW      embedding / output head (paper)
``*norm*.weight``                      AdamW      RMSNorm gains (paper)
``hc_*`` (mHC fn / base / scale)       AdamW      mHC static parameters and gates (paper)
``*.ape``, ``*.attn_sink``             AdamW      FP32-pinned positional bias / sink logits
``ffn.gate.weight`` (router)           AdamW      routing gate, not a hidden transform
any tensor that is not 2-D             AdamW      Muon orthogonalises matrices only
every other 2-D weight                 Muon       wq_*, wkv, wo_*, experts, compressor, indexer…
=====================================  =========  =============================================

With ``optimizer.name: adamw`` every parameter goes to AdamW. Weight decay applies to
matrices (Muon groups, and AdamW for embed / head / router) and never to norms, mHC,
ape or sinks. Parameters built by a phase change (``.indexer.``) get their own groups,
appended after the base groups, so a resumed run rebuilds exactly the same group layout.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from .muon import Muon

GROUP_KINDS = ("muon", "adamw_decay", "adamw_no_decay")
"""Group kinds in the order they are created; group names are ``<kind>/<tag>`` (tag ``base`` or ``indexer``)."""


def adamw_reason(name: str, param: torch.Tensor) -> str | None:
    """Why ``name`` is optimised by AdamW under muon_adamw (None: it goes to Muon)."""
    leaf = name.rsplit(".", 1)[-1]
    if name in ("embed.weight", "head.weight"):
        return "embedding/head"
    parts = name.split(".")
    if leaf == "weight" and len(parts) >= 2 and "norm" in parts[-2]:
        return "rmsnorm"
    if leaf.startswith("hc_"):
        return "mhc"
    if leaf in ("ape", "attn_sink"):
        return leaf
    if name.endswith("ffn.gate.weight"):
        return "router gate"
    if param.ndim != 2:
        return "not a matrix"
    return None


def group_kind(name: str, param: torch.Tensor, optimizer_name: str) -> str:
    """``muon`` | ``adamw_decay`` | ``adamw_no_decay`` for one parameter."""
    reason = adamw_reason(name, param)
    if optimizer_name == "muon_adamw" and reason is None:
        return "muon"
    decays = reason in ("embedding/head", "router gate") or (reason is None and param.ndim == 2)
    return "adamw_decay" if decays else "adamw_no_decay"


def _tag(name: str) -> str:
    return "indexer" if ".indexer." in name else "base"


class Optimizers:
    """Muon + AdamW behind one step/zero_grad interface; groups carry ``name`` and ``kind``.

    ``.optimizers`` is the list given to the checkpoint's ``OptimizerState`` (state keyed by FQN).
    Works on plain parameters and on FSDP2-sharded ones (DTensor, ``Shard(0)``; see
    ``model.parallel.fsdp.apply_fsdp``): AdamW is elementwise, so ``torch.optim.AdamW`` updates each
    shard; Muon is :class:`muon.Muon`, which gathers each matrix's update and orthogonalises the
    whole matrix (docs/parallelism.md "Muon under sharding"). Build it after ``apply_fsdp``.

    Args:
        model: the module whose ``named_parameters`` are optimised (FQNs pick the groups).
        cfg: the recipe's ``optimizer`` section.
        muon_ns_dtype: Newton–Schulz dtype of Muon (bfloat16 as ``torch.optim.Muon``; tests use
            float64 to compare layouts exactly).
        tags: which parameters to take now: ``base`` and/or ``indexer`` (a rebuilt sharded model takes
            ``base``, loads the old state, then :meth:`add_params` the new indexers, as a phase change does).
    """

    def __init__(self, model: nn.Module, cfg: Any, *, muon_ns_dtype: torch.dtype = torch.bfloat16,
                 tags: tuple[str, ...] = ("base", "indexer")) -> None:
        self.cfg = cfg
        self.muon_ns_dtype = muon_ns_dtype
        self.muon: torch.optim.Optimizer | None = None
        self.adamw: torch.optim.Optimizer | None = None
        for tag in tags:
            self.add_params(model, [(n, p) for n, p in model.named_parameters() if _tag(n) == tag], tag)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def add_params(self, model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], tag: str) -> None:
        """Add ``named`` (new, e.g. indexer) parameters as groups ``<kind>/<tag>``."""
        buckets: dict[str, list[torch.Tensor]] = {k: [] for k in GROUP_KINDS}
        for name, p in named:
            if p.requires_grad:
                buckets[group_kind(name, p, self.cfg.name)].append(p)
        c = self.cfg
        for kind in GROUP_KINDS:
            params = buckets[kind]
            if not params:
                continue
            wd = 0.0 if kind == "adamw_no_decay" else c.weight_decay
            group = {"params": params, "name": f"{kind}/{tag}", "kind": kind, "weight_decay": wd}
            if kind == "muon":
                if self.muon is None:
                    self.muon = Muon([group], lr=c.muon_lr, weight_decay=wd, momentum=c.muon_momentum,
                                     ns_dtype=self.muon_ns_dtype)
                else:
                    self.muon.add_param_group(group)
            elif self.adamw is None:
                # fused on GPUs: one kernel per step over all tensors (foreach's seven passes took 26 ms per
                # step in recipes/bench_h200.yaml's profile on an H200)
                fused = True if all(q.is_cuda for q in params) else None
                self.adamw = torch.optim.AdamW([group], lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=wd,
                                               fused=fused)
            else:
                self.adamw.add_param_group(group)

    def set_lr(self, adamw_lr: float, muon_lr: float) -> None:
        """Set the learning rate of every group (Muon groups get ``muon_lr``)."""
        for g in self.param_groups:
            g["lr"] = muon_lr if g["kind"] == "muon" else adamw_lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (``set_to_none``) or zero them in place (a captured CUDA graph writes into them)."""
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def summary(self, model: nn.Module) -> dict[str, dict[str, Any]]:
        """Group name -> {optimizer, dtypes {dtype: count}, n_params, names} (for the manifest and tests)."""
        names = {id(p): n for n, p in model.named_parameters()}
        out: dict[str, dict[str, Any]] = {}
        for g in self.param_groups:
            dtypes: dict[str, int] = {}
            for p in g["params"]:
                key = str(p.dtype).removeprefix("torch.")
                dtypes[key] = dtypes.get(key, 0) + 1
            out[g["name"]] = {"optimizer": "muon" if g["kind"] == "muon" else "adamw", "dtypes": dtypes,
                              "n_params": len(g["params"]), "names": [names.get(id(p), "?") for p in g["params"]]}
        return out
