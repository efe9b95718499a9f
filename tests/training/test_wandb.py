"""logging.wandb: rank 0 logs to Weights & Biases exactly the scalars TensorBoard gets, one W&B run per run
directory (resumed by later jobs); validate and the job say how to install wandb when it is missing.

wandb is never installed for the tests: a fake module in ``sys.modules`` records the calls."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from v4launch.errors import UsageError
from v4launch.recipe_loading import load_recipe
from v4launch.training.job import train
from v4launch.training.metrics import MetricsLogger
from v4launch.training.trackers import WandbLogger, wandb_run_id
from v4launch.validators import validate_recipe

WANDB = {"logging": {"tensorboard": True, "wandb": {"project": "v4-tests", "mode": "offline"}}}


class FakeRun:
    def __init__(self, calls: list, kwargs: dict) -> None:
        self.calls, self.kwargs, self.finished = calls, kwargs, False

    def log(self, data: dict, step: int) -> None:
        self.calls.append((step, dict(data)))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A ``wandb`` module whose ``init`` returns a recording run (``module.runs``; ``module.calls``: every
    ``(step, scalars)`` logged)."""
    module = types.ModuleType("wandb")
    module.runs, module.calls = [], []

    def init(**kwargs):
        run = FakeRun(module.calls, kwargs)
        module.runs.append(run)
        return run

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def tensorboard_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def test_wandb_gets_what_tensorboard_gets_and_a_resume_continues_the_same_run(new_run, fake_wandb):
    run = new_run(WANDB)
    assert train(run, max_steps=4, progress=False).step == 4
    assert train(run, progress=False).status == "completed"
    first, second = fake_wandb.runs
    assert first.kwargs["id"] == second.kwargs["id"] == wandb_run_id(run)  # one W&B run for the run directory
    assert first.kwargs["project"] == "v4-tests" and first.kwargs["mode"] == "offline"
    assert first.kwargs["name"] == run.name and first.kwargs["dir"] == str(run)
    assert first.kwargs["resume"] == "allow" and first.kwargs["config"]["logging"]["wandb"]["project"] == "v4-tests"
    assert first.finished and second.finished
    logged = {(tag, step): v for step, data in fake_wandb.calls for tag, v in data.items()}
    tb = tensorboard_scalars(run)  # float32 in the event files
    assert set(logged) == set(tb)
    assert all(logged[k] == pytest.approx(tb[k], rel=1e-6, abs=1e-12) for k in tb)
    tags = {tag for tag, _ in logged}
    assert {"loss/lm", "eval/lm_loss", "grad_norm", "throughput/tokens_per_s", "aux_sum/balance",
            "aux_sum/indexer_kl", "aux_sum/mtp"} <= tags
    assert sorted({step for _, step in logged}) == list(range(1, 9))  # every step of the 8 once (interval 1)


def test_only_rank_0_logs(tmp_path: Path):
    calls: list = []
    tracker = types.SimpleNamespace(log=lambda data, step: calls.append((step, data)), close=lambda: None)
    for rank in (1, 0):
        logger = MetricsLogger(tmp_path, rank=rank, total_steps=1, tensorboard=False, progress=False,
                               trackers=[tracker])
        logger.eval({"kind": "eval", "at": "stage_end", "stage": "s", "stage_index": 0, "phase": "dense",
                     "step": 1, "step_in_stage": 1, "lm_loss": 2.5})
        logger.close()
    assert calls == [(1, {"eval/lm_loss": 2.5})]


def test_disabled_mode_opens_nothing_and_missing_wandb_is_a_clear_error(new_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    off = new_run({"logging": {"wandb": {"project": "p", "mode": "disabled"}}}, name="off")
    assert train(off, max_steps=1, progress=False).step == 1
    run = new_run(WANDB)
    with pytest.raises(UsageError, match="logging.wandb.mode = offline: the wandb package is not installed") as exc:
        train(run, max_steps=1, progress=False)
    assert "pip install 'v4launch[wandb]'" in exc.value.hint and "logging.wandb.mode=disabled" in exc.value.hint


def test_validate_names_the_missing_package_and_its_install(write_recipe, monkeypatch, fake_wandb):
    path = write_recipe("r", WANDB)
    ok = validate_recipe(load_recipe(path, []))
    assert "V4-WANDB-INSTALLED" not in ok.failed_rule_ids()
    monkeypatch.setitem(sys.modules, "wandb", None)
    (v,) = [v for v in validate_recipe(load_recipe(path, [])).violations if v.rule_id == "V4-WANDB-INSTALLED"]
    assert (v.field, v.value) == ("logging.wandb.mode", "offline")
    assert "wandb package is not installed" in v.message and "pip install 'v4launch[wandb]'" in v.fix


def test_wandb_init_failure_names_the_section_and_the_fix(tmp_path: Path, fake_wandb):
    def refuse(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    fake_wandb.init = refuse
    cfg = types.SimpleNamespace(project="p", name=None, mode="online")
    with pytest.raises(UsageError, match="wandb.init failed: api_key not configured") as exc:
        WandbLogger(cfg, tmp_path, {})
    assert "wandb login" in exc.value.hint and "logging.wandb.mode=offline" in exc.value.hint
