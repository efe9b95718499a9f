"""A run trained with two data-parallel ranks (gloo, two processes) resumes with one, through resharding."""

from __future__ import annotations

import json

import pytest
from train_helpers import train_records

from v4launch.launchers import LocalLauncher, launcher_for
from v4launch.rundir import load_run


@pytest.mark.slow
def test_world_2_checkpoint_resumes_on_world_1(new_run):
    from test_train_crash_and_cli import _cli

    run = new_run({"cluster": {"gpus_per_node": 2}})
    assert isinstance(launcher_for(run), LocalLauncher)
    info = LocalLauncher().launch(run, max_steps=4)
    assert (info.result.status, info.result.step) == ("max_steps", 4)
    assert (run / "logs" / "rank1.log").is_file()
    manifest = json.loads((run / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert manifest["parallel"]["world"] == 2 and manifest["parallel"]["dp"] == 2
    before = train_records(run)

    code, text = _cli("resume", str(run), "cluster.gpus_per_node=1", "--dry-run")
    assert code == 0 and "reshard" in text, text
    code, text = _cli("resume", str(run), "cluster.gpus_per_node=1")
    assert code == 0, text
    assert load_run(run).recipe.cluster.world_size == 1  # the new recipe was re-frozen
    recs = train_records(run)
    assert sorted(recs) == list(range(1, 9)) and all(recs[s] == before[s] for s in before)
    assert recs[8]["tokens"] > recs[4]["tokens"]
    state = json.loads((run / "launch.json").read_text())
    assert state["state"] == "completed"
