"""The optimizer-group tables a checkpoint manifest records, for the WHOLE model whatever the layout."""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoints.base import describe_params
from .dist import gather_objects


def param_group_tables(model: torch.nn.Module, opt: Any, *, gather: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``describe_params`` per optimizer group, ``opt.summary``) of the whole model, for the manifest.

    Under PP each pipeline rank holds other parameters, under EP each EP rank other experts: with
    ``gather`` the tables of every rank are merged (collective over the world), each parameter name
    once, so a manifest reads the same whatever the layout (resume compares them); a group's ``storage`` entry
    (precision-aware storage: master kind and state dtypes) is kept, from a rank whose part of the group holds a
    bf16 parameter where one does.

    Args:
        model: this rank's model (parameters under their single-device FQNs).
        opt: the job's ``Optimizers`` (``param_groups`` with ``name``, ``summary(model)``).
        gather: merge over the world (pp > 1 or ep > 1 on several ranks).
    """
    names = {id(q): n for n, q in model.named_parameters()}
    local = [(g["name"], [(names[id(q)], q.dtype) for q in g["params"]]) for g in opt.param_groups]
    summary = opt.summary(model)
    if gather:
        named: dict[str, dict[str, torch.dtype]] = {}
        kinds: dict[str, str] = {}
        storage: dict[str, dict[str, str]] = {}  # a group's storage (master kind, state dtypes), if any rank has it
        for rank_local, rank_summary in gather_objects((local, summary), None):
            for g, pairs in rank_local:
                named.setdefault(g, {}).update(pairs)
            kinds.update({g: sm["optimizer"] for g, sm in rank_summary.items()})
            for g, sm in rank_summary.items():
                if "storage" in sm and (g not in storage or storage[g].get("master") == "none"):
                    storage[g] = sm["storage"]
        local = [(g, sorted(pairs.items())) for g, pairs in named.items()]
        summary = {}
        for g, pairs in local:
            dtypes: dict[str, int] = {}
            for _, dt in pairs:
                key = str(dt).removeprefix("torch.")
                dtypes[key] = dtypes.get(key, 0) + 1
            summary[g] = {"optimizer": kinds[g], "dtypes": dtypes, "n_params": len(pairs),
                          "names": [n for n, _ in pairs], **({"storage": storage[g]} if g in storage else {})}
    return {g: describe_params((n, torch.empty(0, dtype=dt, device="meta")) for n, dt in pairs)
            for g, pairs in local}, summary
