"""save/load round trip, atomicity under SIGKILL, keep-last pruning, re-saving a step, bad inputs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_helpers import manifest_for

from v4launch.checkpoints import (
    CheckpointError,
    DCPStorage,
    Manifest,
    ModelState,
    OptimizerState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    summarize_param_groups,
)


class Counter:
    """A Stateful data-loader stand-in."""

    def __init__(self, position: int = 0):
        self.position = position

    def state_dict(self):
        return {"position": self.position, "name": "stdlib"}

    def load_state_dict(self, state):
        self.position = state["position"]


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "name": "matrices"},
                             {"params": list(model[1].parameters()) + list(model[2].parameters()), "name": "rest"}], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train_step(model, opt, sched):
    loss = model(torch.ones(4, 6)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def states(model, opt, sched, loader, step):
    return {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "lr_scheduler": sched,
            "dataloader": loader, "train_state": {"step": step, "tokens": step * 4096},
            "curriculum": {"stage_index": 1, "stage_name": "warmup_1k"}}


def test_round_trip_model_optimizer_scheduler_and_dicts(tmp_path, recipe):
    model, opt, sched = build(0)
    for _ in range(3):
        train_step(model, opt, sched)
    man = manifest_for(recipe, 1, param_groups=summarize_param_groups(model, opt), step=3)
    path = save_checkpoint(tmp_path, 3, states(model, opt, sched, Counter(17), 3), man)
    assert path == tmp_path / "step_00000003" and latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    assert Manifest.read(path) == man.replace(complete=True)

    model2, opt2, sched2 = build(1)  # other init, fresh optimizer without state
    loader2, target = Counter(), states(model2, opt2, sched2, Counter(), 0)
    target["dataloader"] = loader2
    got = load_checkpoint(path, target)
    assert got.step == 3 and loader2.position == 17
    assert target["train_state"] == {"step": 3, "tokens": 3 * 4096} and target["curriculum"]["stage_name"] == "warmup_1k"
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert sched2.last_epoch == sched.last_epoch and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    train_step(model, opt, sched)
    train_step(model2, opt2, sched2)  # identical optimizer state -> identical next step
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_bad_keys_and_incomplete_checkpoints(tmp_path, recipe):
    with pytest.raises(CheckpointError, match="not part of the contract"):
        save_checkpoint(tmp_path, 1, {"weights": {}}, manifest_for(recipe))
    (tmp_path / "step_00000009").mkdir()
    assert latest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path / "absent") is None
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_00000009", {"train_state": {"step": 0}})


def test_damaged_shard_is_a_clear_error_naming_the_fallback(tmp_path, recipe):
    model, opt, sched = build(0)
    for step in (1, 2):
        train_step(model, opt, sched)
        man = manifest_for(recipe, 1, param_groups=summarize_param_groups(model, opt), step=step)
        path = save_checkpoint(tmp_path, step, states(model, opt, sched, Counter(step), step), man)
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:64])  # truncated, as by a full disk or a bad copy
    model2, opt2, sched2 = build(1)
    with pytest.raises(CheckpointError, match="cannot be read") as info:
        load_checkpoint(path, states(model2, opt2, sched2, Counter(), 0))
    assert "--checkpoint step_00000001" in info.value.hint  # the older complete one, through resume
    only = tmp_path / "alone"
    train_step(model, opt, sched)
    lone = save_checkpoint(only, 3, states(model, opt, sched, Counter(3), 3),
                           manifest_for(recipe, 1, param_groups=summarize_param_groups(model, opt), step=3))
    (lone / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot be read") as info:
        load_checkpoint(lone, states(model2, opt2, sched2, Counter(), 0))
    assert "no other complete checkpoint" in info.value.hint and "mv " in info.value.hint


def test_keep_last_prunes_only_complete_older_ones(tmp_path, recipe):
    incomplete = tmp_path / "step_00000000"
    incomplete.mkdir(parents=True)
    storage = DCPStorage(tmp_path)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"train_state": {"step": step}}, manifest_for(recipe, step=step), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert incomplete.is_dir() and storage.latest() == tmp_path / "step_00000005"
    with pytest.raises(ValueError, match="keep_last"):
        storage.prune(0)


def test_resaving_a_step_replaces_it(tmp_path, recipe):
    save_checkpoint(tmp_path, 4, {"train_state": {"step": 4, "v": 1}}, manifest_for(recipe, step=4))
    save_checkpoint(tmp_path, 4, {"train_state": {"step": 4, "v": 2}}, manifest_for(recipe, step=4))
    target = {"train_state": {"step": 0, "v": 0}}
    load_checkpoint(tmp_path / "step_00000004", target)
    assert target["train_state"]["v"] == 2 and [p.name for p in tmp_path.iterdir()] == ["step_00000004"]


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed.checkpoint as dcp
    sys.path.insert(0, {helpers!r})
    from ckpt_helpers import manifest_for, tiny_dict
    from v4launch.checkpoints import save_checkpoint
    from v4launch.validators.schema import Recipe

    root = {root!r}
    recipe = Recipe.model_validate(tiny_dict())
    w = torch.arange(1000.0)
    save_checkpoint(root, 1, {{"model": {{"w": w}}}}, manifest_for(recipe, step=1))
    original = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        fut = original(self, plan, planner)
        fut.wait()  # shards are on disk, .metadata and manifest are not
        os.kill(os.getpid(), signal.SIGKILL)

    dcp.FileSystemWriter.write_data = write_then_die
    save_checkpoint(root, 2, {{"model": {{"w": w * 2}}}}, manifest_for(recipe, step=2))
""")


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, recipe):
    script = KILLED_SAVE.format(root=str(tmp_path), helpers=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    tmp = tmp_path / ".tmp-step_00000002"
    assert tmp.is_dir() and any(p.suffix == ".distcp" for p in tmp.iterdir()) and not (tmp / "manifest.json").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    target = {"model": {"w": torch.zeros(1000)}}
    assert load_checkpoint(latest_checkpoint(tmp_path), target).step == 1
    assert torch.equal(target["model"]["w"], torch.arange(1000.0))
    save_checkpoint(tmp_path, 3, {"model": {"w": torch.ones(1000)}}, manifest_for(recipe, step=3))
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]  # the killed save's leftovers are gone
