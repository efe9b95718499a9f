"""A recipe sized for GPUs on a machine without them (or with fewer than the local launcher's processes) is
refused before any data is prepared or any directory written, by `v4launch run` and again by the job; it used
to train a bench-sized model on the CPU (a 1-step `v4launch run recipes/bench_h200.yaml` on a CPU machine ran
for over ten minutes before it could be stopped)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from v4launch.errors import UsageError
from v4launch.training.job import train
from v4launch.training.runner import refuse_missing_gpus

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("gpu,index,devices,field", [
    ("H200", 0, 0, "cluster.gpu"),
    ("H100", 3, 0, "cluster.gpu"),
    ("H200", 8, 8, "cluster.gpus_per_node"),
    ("B200", 15, 8, "cluster.gpus_per_node"),
])
def test_a_missing_gpu_is_refused_naming_the_field_and_the_fix(gpu, index, devices, field):
    with pytest.raises(UsageError) as err:
        refuse_missing_gpus(gpu, index, devices)
    assert err.value.message.startswith(field) and "fix:" in err.value.hint
    if devices == 0:
        assert gpu in err.value.message and "cluster.gpu=cpu" in err.value.hint
    else:
        assert f"GPU {index}" in err.value.message and f"cluster.gpus_per_node={devices}" in err.value.hint


@pytest.mark.parametrize("gpu,index,devices", [("cpu", 0, 0), ("cpu", 7, 0), ("H200", 0, 1), ("H100", 7, 8)])
def test_what_the_machine_holds_passes(gpu, index, devices):
    refuse_missing_gpus(gpu, index, devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_run_of_a_gpu_recipe_here_writes_nothing(workspace):
    from typer.testing import CliRunner

    from v4launch.cli import app

    before = sorted(p.relative_to(workspace) for p in workspace.rglob("*"))
    result = CliRunner().invoke(app, ["run", str(REPO / "recipes" / "bench_h200.yaml"), "--max-steps", "1"])
    assert isinstance(result.exception, UsageError), result.output
    assert result.exception.exit_code == 2
    assert "cluster.gpu = H200" in result.exception.message and "no CUDA GPU" in result.exception.message
    # the workspace remembers the recipe named (.v4launch/state.json); no run directory, no prepared data
    after = sorted(p.relative_to(workspace) for p in workspace.rglob("*") if p.name != "state.json")
    assert after == before, set(after) - set(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_the_job_refuses_before_preparing_data(new_run, monkeypatch):
    """A run directory made elsewhere (a Slurm job lands on a node without GPUs): the job stops first thing."""
    run = new_run({"cluster": {"gpu": "H100"}})
    import v4launch.training.job as job

    def never(*args, **kwargs):
        raise AssertionError("data prepared before the GPU check")

    monkeypatch.setattr(job, "prepare_for_run", never)
    with pytest.raises(UsageError, match="cluster.gpu = H100"):
        train(run, progress=False)
