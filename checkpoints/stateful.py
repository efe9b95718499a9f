"""``Stateful`` wrappers for the ``model`` and ``optimizer`` keys, keyed by parameter name (FQN).

``optimizer.state_dict()`` keys state by position and is empty before the first
step, so a fresh optimizer cannot be a load target and a regrouped one would load
the wrong tensors. ``torch.distributed.checkpoint.state_dict`` keys optimizer
state by parameter FQN and initialises empty state, so these wrappers load into a
freshly built optimizer, under FSDP2/DTensor sharding or none.

Source: torch.distributed.checkpoint.state_dict (``get_model_state_dict``,
``get_optimizer_state_dict``, ``set_*``); torchtitan ``ModelWrapper``/``OptimizersContainer``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..training.master_weights import drop_initial_remainders


def _fqn(name: str) -> str:
    """``named_parameters``' name without wrapper segments (``_orig_mod``, ``_checkpoint_wrapped_module``), as
    ``get_model_state_dict`` keys it."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


class ModelState:
    """Stateful view of a module's parameters and buffers (FQN → tensor)."""

    def __init__(self, model: torch.nn.Module, *, strict: bool = True):
        self.model = model
        self.options = StateDictOptions(strict=strict)

    def state_dict(self) -> dict[str, Any]:
        """FQN → tensor (DTensor under FSDP2)."""
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy ``state_dict`` into the module. Raises RuntimeError on missing/unexpected keys when strict.

        A loaded bf16-stored parameter forgets the fp32 value it was built from (``master_weights.store_in_bf16``):
        its master comes from the checkpoint's optimizer state, or else from the loaded value itself."""
        set_model_state_dict(self.model, state_dict, options=self.options)
        drop_initial_remainders(p for name, p in self.model.named_parameters() if _fqn(name) in state_dict)


class OptimizerState:
    """Stateful view of one or more optimizers over ``model`` (state keyed by parameter FQN).

    The state dict is FLATTENED (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``): every entry
    belongs to one parameter, so ranks that hold different parameters (pipeline stages) save and
    load only their own entries, and a checkpoint loads into any pipeline layout (torchtitan does
    the same for PP). Unflattened, ``param_groups`` would be one list that only one rank's copy of
    survives.
    """

    def __init__(self, model: torch.nn.Module, optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]):
        self.model = model
        self.optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        """``{"state.<fqn>.<key>": ..., "param_groups.<fqn>.<key>": ...}`` merged over the optimizers."""
        return get_optimizer_state_dict(self.model, self.optimizers, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every optimizer's state and hyper-parameters from ``state_dict``."""
        set_optimizer_state_dict(self.model, self.optimizers, state_dict, options=self.options)
