"""Resharding: save from 2 gloo ranks (sharded DTensor + DP-replicated tensors), load in 1 process, and back."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ckpt_helpers import manifest_for, tiny_dict

from v4launch.checkpoints import Manifest, latest_checkpoint, load_checkpoint, save_checkpoint
from v4launch.validators.schema import Recipe

pytestmark = pytest.mark.slow

FULL = torch.arange(64.0).reshape(16, 4)
REPLICA = torch.linspace(0.0, 1.0, 10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _manifest(world: int) -> Manifest:
    recipe = Recipe.model_validate(tiny_dict())
    return manifest_for(recipe, 1, step=7, parallel_sizes={"world": world, "dp": world, "cp": 1, "pp": 1, "tp": 1, "ep": 1})


def _save_on_two(rank: int, root: str, port: int) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _init(rank, 2, port)
    try:
        states = {"model": {"sharded": distribute_tensor(FULL, mesh, [Shard(0)]), "replicated": REPLICA.clone()},
                  "train_state": {"step": 7}, "dataloader": {"epoch": 0, "position": 5, "offset": 0}}
        path = save_checkpoint(root, 7, states, _manifest(2))
        assert path.name == "step_00000007"
    finally:
        dist.destroy_process_group()


def _load_on_two(rank: int, root: str, port: int) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = _init(rank, 2, port)
    try:
        target = {"model": {"sharded": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "replicated": torch.zeros(10)},
                  "train_state": {"step": 0}}
        manifest = load_checkpoint(latest_checkpoint(root), target)
        local = target["model"]["sharded"]
        assert isinstance(local, DTensor) and manifest.parallel["world"] == 1
        assert torch.equal(local.to_local(), FULL[rank * 8:(rank + 1) * 8])
        assert torch.equal(target["model"]["replicated"], REPLICA) and target["train_state"]["step"] == 7
    finally:
        dist.destroy_process_group()


def test_save_two_ranks_load_one_process(tmp_path):
    mp.spawn(_save_on_two, args=(str(tmp_path), _free_port()), nprocs=2, join=True)
    path = latest_checkpoint(tmp_path)
    assert path is not None and sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    target = {"model": {"sharded": torch.zeros(16, 4), "replicated": torch.zeros(10)},
              "train_state": {"step": 0}, "dataloader": {"epoch": -1, "position": -1, "offset": -1}}
    manifest = load_checkpoint(path, target)
    assert manifest.parallel["world"] == 2 and manifest.complete
    assert torch.equal(target["model"]["sharded"], FULL) and torch.equal(target["model"]["replicated"], REPLICA)
    assert target["train_state"] == {"step": 7} and target["dataloader"]["position"] == 5


def test_save_one_process_load_two_ranks(tmp_path):
    save_checkpoint(tmp_path, 7, {"model": {"sharded": FULL.clone(), "replicated": REPLICA.clone()},
                                  "train_state": {"step": 7}}, _manifest(1))
    mp.spawn(_load_on_two, args=(str(tmp_path), _free_port()), nprocs=2, join=True)
