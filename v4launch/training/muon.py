"""Muon that orthogonalises whole matrices when the parameters are sharded (FSDP2 DTensors).

Spec: docs/parallelism.md "Muon under sharding". Math: ``torch.optim.Muon`` of torch 2.13
(``torch/optim/_muon.py``; Keller Jordan's Muon), reproduced step for step so that on plain
tensors the result is the same to the last bit. Per parameter ``W`` [A, B] with gradient ``G``
(group values lr, weight_decay λ, momentum μ, nesterov, ns_coefficients (a, b, c), ns_steps k,
eps, adjust_lr_fn):

1. momentum, elementwise, on this rank's shard: ``M ← M + (1-μ)(G - M)`` (``lerp``);
   ``U = G + μ(M - G)`` with nesterov, else ``U = M``;
2. the whole ``U`` [A, B]: gathered from the shards (one all-gather per matrix; nothing for a
   plain tensor);
3. Newton–Schulz on the whole matrix in ``ns_dtype`` (bf16 as torch): ``X = U`` (transposed
   when A > B), ``X ← X / max(‖X‖_F, eps)``, k times ``Y = X Xᵀ``, ``X ← a X + (b Y + c Y²) X``;
4. this rank's rows of the orthogonalised ``O`` (the same ``Shard(0)`` chunk as ``W``'s);
5. ``W ← W (1 - lr λ)``, then ``W ← W - lr' O`` with ``lr' = lr · sqrt(max(1, A/B))``
   (adjust_lr_fn None / "original"), ``lr · 0.2 · sqrt(max(A, B))`` ("match_rms_adamw"); A, B
   are the GLOBAL shape.

State (``momentum_buffer``, a DTensor shaped like the parameter under FSDP) and param-group keys
are torch.optim.Muon's, so checkpoints of either load into the other.

Precision-aware storage (``storage=StorageOptions``, ``master_weights.py``; Megatron-LM's
``store_param_remainders`` / ``exp_avg_dtype``): a bf16 parameter keeps an exact fp32 master in its state
(``master_remainder`` int16, or ``master_param`` fp32), and ``momentum_buffer`` may be stored in bf16.
Steps 1-5 then run, chunk by chunk, on fp32 temporaries (the master; the bf16 gradient and momentum
upcast), so the master's trajectory is bitwise the one of an fp32 parameter under this Muon (same
``ns_dtype``) given the same gradients; the master is split back into the bf16 parameter (nearest, ties
away) and its remainder, the momentum rounded to nearest even into its storage.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from .master_weights import (StorageOptions, check_param, drop_initial_remainders, ensure_master, master_work,
                             restore_loaded_dtypes, store_master, store_state, upcast)


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Approximate orthogonalisation ``U S' Vᵀ`` of a matrix [A, B] (or a stack [n, A, B], each on its own) in ``dtype``.

    Quintic Newton–Schulz iteration (torch.optim.Muon's op order, so a single matrix is bitwise equal
    to torch's in bf16): work on the wide orientation (rows <= columns), scale each matrix to Frobenius
    norm <= 1, then ``steps`` times ``X ← a X + (b G + c G²) X`` with ``G = X Xᵀ``. A stack runs the same
    iteration with batched GEMMs (``baddbmm``): one kernel per op for all n matrices instead of n.
    Raises:
        ValueError: ``update`` is not 2-D or 3-D, ``steps`` >= 100, or not three coefficients.
    """
    if update.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a matrix or a stack of matrices, got shape {tuple(update.shape)}")
    if steps >= 100 or len(coefficients) != 3:
        raise ValueError(f"Muon ns_steps={steps} (must be < 100), ns_coefficients={coefficients} (must be 3 values)")
    a, b, c = coefficients
    tall = update.shape[-2] > update.shape[-1]
    x = update.to(dtype, copy=True)  # never the caller's tensor (e.g. the momentum buffer): scaled in place below
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G²
            x = torch.addmm(x, poly, x, beta=a)  # a X + poly X
    else:
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate for a [A, B, ...] parameter (torch.optim.Muon's rule, see module doc)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (a view: in-place ops change ``t``)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole matrix of which ``local`` is this rank's shard, sharded like ``like`` (all-gather)."""
    if not isinstance(like, DTensor):
        return local
    shards = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                stride=like.stride())
    return shards.full_tensor()


def _my_shard(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``whole`` under ``like``'s placements (a local slice, no communication)."""
    if not isinstance(like, DTensor):
        return whole
    mesh = like.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose step sees whole matrices when parameters are sharded DTensors.

    Same constructor as ``torch.optim.Muon`` plus ``ns_dtype`` (the Newton–Schulz dtype;
    bfloat16 as torch; float64 / float32 for exact comparisons in tests). Plain-tensor
    parameters (e.g. expert-parallel experts next to FSDP-sharded matrices) take the same
    path without communication. Cost under sharding: one all-gather of each matrix's update
    per step and Newton–Schulz on the whole matrix on every rank of the shard group.

    ``storage`` (None: states in the parameter's dtype, as torch) selects the precision-aware storage of
    the module docstring. Bytes per parameter: fp32 weight 4 + gradient 4 + momentum 4; bf16 weight with
    remainder 2 + 2, gradient 2, momentum 4 (bf16: 2).

    Raises:
        ValueError: as ``torch.optim.Muon`` (a parameter that is not 2-D, negative lr, ...), or
            ns_steps >= 100 / not three ns_coefficients in a group; with ``storage``, a float16 parameter.
    """

    def __init__(self, params: Any, *args: Any, ns_dtype: torch.dtype = torch.bfloat16,
                 storage: StorageOptions | None = None, **kwargs: Any) -> None:
        self.storage = storage  # read by add_param_group, which torch's constructor calls
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["ns_steps"] >= 100 or len(group["ns_coefficients"]) != 3:
                raise ValueError(f"Muon group {group.get('name', '?')}: ns_steps={group['ns_steps']} must be < 100 "
                                 f"and ns_coefficients={group['ns_coefficients']} three values. Fix: use the "
                                 "defaults (5 steps, (3.4445, -4.7750, 2.0315)).")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; with ``storage``, float16 parameters are refused (ValueError)."""
        super().add_param_group(param_group)
        if self.storage is not None:
            for p in self.param_groups[-1]["params"]:
                check_param(p, self.storage)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``; with ``storage``, states keep their storage dtypes (torch would cast them
        to the parameter's dtype: a bf16 parameter's fp32 momentum to bf16). Raises: as
        :func:`master_weights.restore_loaded_dtypes` (a bf16 parameter's state without its master)."""
        super().load_state_dict(state_dict)
        if self.storage is not None:
            restore_loaded_dtypes(self, state_dict, self.storage)
        drop_initial_remainders(p for group in self.param_groups for p in group["params"] if p in self.state)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step over every group (see the module docstring); returns ``closure()`` if given.

        Parameters go in chunks of at most :attr:`stack_elements` update elements (so the gathered
        updates of a sharded model never all live at once). Per chunk: the momentum of every matrix in
        one ``torch._foreach_lerp_`` (and one out-of-place lerp for Nesterov), Newton–Schulz per
        same-shape stack (:func:`newton_schulz` on [n, A, B]), and the decay and update of each stack's
        matrices in one ``_foreach_mul_`` / ``_foreach_add_``. Each matrix's result is its own: the
        same elementwise ops and the same per-matrix iteration as one matrix at a time.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            chunk: list[torch.Tensor] = []
            held = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("Muon supports dense real parameters only")
                chunk.append(p)
                held += p.numel()
                if held >= self.stack_elements:
                    self._step_chunk(chunk, group)
                    chunk, held = [], 0
            if chunk:
                self._step_chunk(chunk, group)
        return loss

    stack_elements: int = 1 << 26
    """Upper bound on the update elements held for one chunk of the step (64 Mi: 256 MiB in float32)."""

    def _step_chunk(self, params: list[torch.Tensor], group: dict) -> None:
        """Steps 1-5 for ``params`` (all with gradients): momentum, whole updates, Newton–Schulz, update.

        Without ``storage`` the parameters, gradients and momentum buffers are updated as they are. With it,
        on fp32 temporaries of this chunk: a bf16 parameter's master (:func:`master_weights.master_work`),
        bf16 gradients and bf16-stored buffers upcast; then the master is split back into the bf16 parameter
        (and its remainder) and the buffers are rounded to their storage dtype (nearest even).
        """
        if self.storage is None:
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            self._update(params, [_local(p) for p in params], [_local(p.grad) for p in params],
                         [_local(self.state[p]["momentum_buffer"]) for p in params], group)
            return
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if "momentum_buffer" not in state:
                dtype = self.storage.state_dtype("momentum_buffer", p)
                state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=dtype, memory_format=torch.preserve_format)
            ensure_master(state, p, self.storage)
        masters = [master_work(p, state) for p, state in zip(params, states)]
        bufs = [upcast(state["momentum_buffer"]) for state in states]
        self._update(params, masters, [upcast(p.grad) for p in params], bufs, group)
        for p, state, master, buf in zip(params, states, masters, bufs):
            store_master(p, state, master)
            store_state(state["momentum_buffer"], buf)

    def _update(self, params: list[torch.Tensor], works: list[torch.Tensor], grads: list[torch.Tensor],
                bufs: list[torch.Tensor], group: dict) -> None:
        """Steps 1-5 on local tensors: ``works[i]`` (the weights updated in place; ``params[i]``'s local piece or
        its fp32 master), ``grads[i]`` and ``bufs[i]`` (momentum, updated in place); ``params`` give the shapes
        and placements."""
        momentum = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        stacks: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        for i, (p, update) in enumerate(zip(params, updates)):
            whole = _whole(update, p)
            stacks.setdefault((tuple(whole.shape), whole.device), []).append((i, whole))
        lr = float(group["lr"])
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
        for items in stacks.values():
            if len(items) == 1:
                orthos = [newton_schulz(items[0][1], *args)]
            else:
                orthos = newton_schulz(torch.stack([w for _, w in items]), *args).unbind(0)
            locals_ = [works[i] for i, _ in items]
            torch._foreach_mul_(locals_, 1 - lr * group["weight_decay"])
            shape = params[items[0][0]].shape  # same global shape: one adjusted learning rate for the stack
            torch._foreach_add_(locals_, [_my_shard(o, params[i]) for (i, _), o in zip(items, orthos)],
                                alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))
