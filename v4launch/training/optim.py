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
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw
from torch.optim.optimizer import _default_to_fused_or_foreach, _get_scalar_dtype

from ..model.parallel.data_parallel import scale_grads
from .master_weights import (StorageOptions, check_param, drop_initial_remainders, ensure_master, local_view,
                             master_work, restore_loaded_dtypes, store_master, store_state, upcast)
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


class PrecisionAwareAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with bf16 parameters over an exact fp32 master and bf16-stored moments.

    Source: Megatron-LM's precision-aware optimizer (``store_param_remainders``, ``exp_avg_dtype``,
    ``exp_avg_sq_dtype``); the math is torch's own functional ``torch.optim.adamw.adamw`` (torch 2.13), run
    on fp32 temporaries with the implementation (fused / foreach / single-tensor) torch's ``AdamW.step``
    would pick for these parameters and flags. Given the same gradients, a bf16 parameter's master follows
    bitwise the trajectory of an fp32 parameter under ``torch.optim.AdamW`` with the same hyper-parameters.

    Per step and group, parameters go in chunks of at most :attr:`chunk_elements` elements (a larger
    parameter is a chunk of its own). For each chunk: the fp32 master (the parameter itself when it is not
    bf16; the fp32 copy ``master_param``; or a new tensor joined from the bf16 parameter and its int16
    ``master_remainder``), the gradient (bf16 upcast) and ``exp_avg`` / ``exp_avg_sq`` (bf16 upcast) go
    through ``adamw``; the master is written back (split into parameter + remainder, or the parameter
    rounded ties-away from the copy) and bf16 moments are rounded to nearest even. Transient memory: at most
    four fp32 tensors of the chunk (master, gradient, two moments) plus ``adamw``'s own temporaries.

    State keys are torch's (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) plus the master's
    (``master_remainder`` int16 or ``master_param`` fp32, bf16 parameters only), created at a parameter's
    first step (the master from the parameter's value: remainder zeros). ``step`` is placed as torch places
    it (a CPU scalar, or on the device when fused / capturable). Bytes per parameter: fp32 4 + gradient 4 +
    moments 4 + 4; bf16 with remainder 2 + 2, gradient 2, moments 4 + 4 (bf16: 2 + 2).

    Args:
        params, **kwargs: as ``torch.optim.AdamW`` (``differentiable`` is not supported).
        storage: masters and state dtypes (``master_weights.StorageOptions``).
    Raises:
        ValueError: as ``torch.optim.AdamW``; a float16 parameter.
        RuntimeError: ``differentiable=True``; a sparse or complex gradient at ``step``.
    """

    chunk_elements: int = 1 << 26
    """Upper bound on the parameter elements one chunk of the step holds in fp32 (64 Mi: 256 MiB a tensor)."""

    def __init__(self, params: Any, *, storage: StorageOptions, **kwargs: Any) -> None:
        if kwargs.get("differentiable"):
            raise RuntimeError("PrecisionAwareAdamW: differentiable=True is not supported (the step writes masters "
                               "and states in place). Fix: use torch.optim.AdamW (storage None).")
        self.storage = storage  # read by add_param_group, which torch's constructor calls
        super().__init__(params, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; float16 parameters are refused (ValueError)."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            check_param(p, self.storage)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` with states kept in their storage dtypes (torch casts them to the
        parameter's). Raises: as :func:`master_weights.restore_loaded_dtypes`."""
        super().load_state_dict(state_dict)
        restore_loaded_dtypes(self, state_dict, self.storage)
        drop_initial_remainders(p for group in self.param_groups for p in group["params"] if p in self.state)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every group (see the class docstring); returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("PrecisionAwareAdamW supports dense real parameters only")
            if not params:
                continue
            fused, foreach = group["fused"], group["foreach"]
            if fused is None and foreach is None:  # torch's default, decided on the parameters themselves
                _, foreach = _default_to_fused_or_foreach(params, False, use_fused=False)
                foreach = foreach and not (torch.is_tensor(group["lr"]) and not group["capturable"])
            chunk: list[torch.Tensor] = []
            held = 0
            for p in params:
                chunk.append(p)
                held += p.numel()
                if held >= self.chunk_elements:
                    self._step_chunk(chunk, group, bool(fused), bool(foreach))
                    chunk, held = [], 0
            if chunk:
                self._step_chunk(chunk, group, bool(fused), bool(foreach))
        return loss

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        """``p``'s state, created as torch's ``Adam._init_group`` does (moments in their storage dtypes)."""
        state = self.state[p]
        if "step" not in state:
            on_device = group["capturable"] or group["fused"]
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
                             if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype()))
            keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for key in keys:
                state[key] = torch.zeros_like(p, dtype=self.storage.state_dtype(key, p),
                                              memory_format=torch.preserve_format)
        ensure_master(state, p, self.storage)
        return state

    def _step_chunk(self, params: list[torch.Tensor], group: dict, fused: bool, foreach: bool) -> None:
        """One ``adamw`` call on fp32 temporaries of ``params`` (all with gradients), then the write-back."""
        states = [self._state(p, group) for p in params]
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        moments = {k: [upcast(state[k]) for state in states] for k in keys}
        masters = [master_work(p, state) for p, state in zip(params, states)]
        beta1, beta2 = group["betas"]
        adamw(masters, [upcast(local_view(p.grad)) for p in params], moments["exp_avg"], moments["exp_avg_sq"],
              moments.get("max_exp_avg_sq", []), [state["step"] for state in states], foreach=foreach,
              capturable=group["capturable"], differentiable=False, fused=fused,
              grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
              has_complex=False, amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        for p, state, master in zip(params, states, masters):
            store_master(p, state, master)
        for key in keys:
            for state, work in zip(states, moments[key]):
                store_state(state[key], work)


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
        storage: None (default): ``torch.optim.AdamW`` (fused on GPUs) and :class:`muon.Muon` as they are.
            A ``master_weights.StorageOptions`` (``storage_for(recipe.precision)``): :class:`PrecisionAwareAdamW`
            and Muon with exact fp32 masters for bf16 parameters (convert them before building this) and
            moments stored in the given dtypes; the update math is the same, in fp32.
        fused: AdamW's ``fused`` flag; None (default): fused when every parameter is on a GPU, torch's default
            (foreach) otherwise.
    """

    def __init__(self, model: nn.Module, cfg: Any, *, muon_ns_dtype: torch.dtype = torch.bfloat16,
                 tags: tuple[str, ...] = ("base", "indexer"), storage: StorageOptions | None = None,
                 fused: bool | None = None) -> None:
        self.cfg = cfg
        self.fused = fused
        self.muon_ns_dtype = muon_ns_dtype
        self.storage = storage
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
                                     ns_dtype=self.muon_ns_dtype, storage=self.storage)
                else:
                    self.muon.add_param_group(group)
            elif self.adamw is None:
                # fused on GPUs: one kernel per step over all tensors (foreach's seven passes took 26 ms per
                # step in recipes/bench_h200.yaml's profile on an H200)
                fused = self.fused if self.fused is not None else (True if all(q.is_cuda for q in params) else None)
                if self.storage is None:
                    self.adamw = torch.optim.AdamW([group], lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                                                   weight_decay=wd, fused=fused)
                else:
                    self.adamw = PrecisionAwareAdamW([group], lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                                                     weight_decay=wd, fused=fused, storage=self.storage)
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

    def step(self, clip: torch.Tensor | None = None) -> None:
        """One step of every optimizer, the gradients first multiplied by ``clip`` (a 0-d tensor, the global-norm
        clip coefficient of ``data_parallel.clip_coefficient``; None: as they are).

        A fused AdamW over plain tensors takes the clip as its ``grad_scale`` (the divisor torch's
        ``_fused_adamw_`` applies to each gradient as it reads it, written back clipped): no separate pass over
        the gradients. Muon, an AdamW that is not fused (CPU, foreach) and FSDP-sharded (DTensor) parameters get
        their gradients multiplied in place first (``data_parallel.scale_grads``). Either way the update is
        AdamW's on the clipped gradients. ``p.grad`` holds them after the step, except a bf16 gradient under
        precision-aware storage with the clip folded: the step divides its fp32 temporary, not ``p.grad``.
        """
        for o in self.optimizers:
            grads = [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]
            if clip is None or not grads:
                o.step()
            elif o is self.adamw and all(g["fused"] for g in o.param_groups) and \
                    not any(isinstance(t, DTensor) for t in grads):
                o.grad_scale = torch.reciprocal(clip.float())
                try:
                    o.step()
                finally:
                    del o.grad_scale
            else:
                scale_grads(grads, clip)
                o.step()

    def summary(self, model: nn.Module) -> dict[str, dict[str, Any]]:
        """Group name -> {optimizer, dtypes {dtype: count}, n_params, names} (for the manifest and tests).

        With ``storage``, each group also has ``storage``: {"master": "int16_remainder" | "fp32_copy" |
        "none" (no bf16 parameter), and per state key its storage dtype names, e.g. "exp_avg": "bfloat16"}.
        """
        names = {id(p): n for n, p in model.named_parameters()}
        out: dict[str, dict[str, Any]] = {}
        for g in self.param_groups:
            dtypes: dict[str, int] = {}
            for p in g["params"]:
                key = str(p.dtype).removeprefix("torch.")
                dtypes[key] = dtypes.get(key, 0) + 1
            out[g["name"]] = {"optimizer": "muon" if g["kind"] == "muon" else "adamw", "dtypes": dtypes,
                              "n_params": len(g["params"]), "names": [names.get(id(p), "?") for p in g["params"]]}
            if self.storage is not None:
                keys = ("momentum_buffer",) if g["kind"] == "muon" else ("exp_avg", "exp_avg_sq")
                out[g["name"]]["storage"] = self.storage.describe(g["params"], keys)
        return out
