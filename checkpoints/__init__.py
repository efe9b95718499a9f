"""Checkpoints: torch.distributed.checkpoint saves under fixed keys, a JSON manifest, resume checks.

Imports torch and ``v4launch.validators`` only. Layout and verdict table: docs/checkpoints.md.

    base.py      the contract: STATE_KEYS, Manifest, CheckpointStorage, param-group summaries
    dcp.py       save_checkpoint / load_checkpoint / latest_checkpoint / prune (atomic, reshardable)
    stateful.py  ModelState / OptimizerState: FQN-keyed Stateful wrappers for DCP
    compat.py    check_resume -> CompatReport (safe / reshard / refused + override flag)
"""

from .base import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PARALLEL_KEYS,
    STATE_KEYS,
    CheckpointError,
    CheckpointStorage,
    Manifest,
    csa_layer_ids,
    describe_params,
    global_layer_ids,
    recipe_hash,
    summarize_param_groups,
)
from .compat import ALLOW_FLAGS, CompatItem, CompatReport, check_resume
from .dcp import DCPStorage, is_complete, latest_checkpoint, list_checkpoints, load_checkpoint, prune, save_checkpoint, step_dir_name
from .stateful import ModelState, OptimizerState

__all__ = [n for n, v in dict(globals()).items() if not n.startswith("_") and not isinstance(v, type(__import__("sys")))]
