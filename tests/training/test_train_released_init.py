"""A run with ``model.init_from_released`` starts from the imported weights: its step-1 LM loss (computed
before the first update) equals the source model's loss on the same micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from train_helpers import train_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
from released_helpers import random_release, released_config, truth, write_release  # noqa: E402

from v4launch.checkpoints.released_import import import_released  # noqa: E402
from v4launch.data.packing import PackedBatchLoader  # noqa: E402
from v4launch.model import V4Model  # noqa: E402
from v4launch.rundir import load_run, read_run_json  # noqa: E402
from v4launch.training.data_io import prepare_for_run  # noqa: E402
from v4launch.training.dist import DistInfo  # noqa: E402
from v4launch.training.job import train  # noqa: E402
from v4launch.training.model_adapter import model_args_from_recipe  # noqa: E402

SPARSE_FIRST = {"curriculum": {"stages": [{"name": "sparse", "seq_len": 64, "phase": "sparse", "steps": 3}]}}


def test_step0_loss_of_a_run_from_an_import_equals_the_source_models_loss(workspace, new_run):
    probe = new_run(SPARSE_FIRST, name="probe")
    recipe = load_run(probe).recipe
    args = model_args_from_recipe(recipe)
    release = random_release(args, int(torch.randint(0, 2**31 - 1, ())))
    write_release(workspace / "release", release, released_config(args, recipe.model.max_position_embeddings))
    import_released(workspace / "release", workspace / "imported", args, recipe_name=recipe.name)

    run = new_run({**SPARSE_FIRST, "model": {"init_from_released": str(workspace / "imported")}})
    result = train(run, max_steps=1, progress=False)
    assert result.status == "max_steps"
    logged = train_records(run)[1]["lm_loss"]

    source = V4Model(args, phase="sparse")
    source.load_state_dict({n: truth(n, release).to(v.dtype) for n, v in source.state_dict().items()})
    dataset = prepare_for_run(load_run(run).recipe, read_run_json(run), run, DistInfo(0, 1, 0, torch.device("cpu"), False))
    loader = PackedBatchLoader(dataset.train_prefix, seq_len=64, seed=recipe.data.seed, dp_rank=0, dp_size=1)
    batches = [next(loader) for _ in range(recipe.parallel.global_batch_size)]  # dp 1, micro-batch 1: accum = gbs
    with torch.no_grad():
        want = sum(source(b.tokens, b.cu_seqlens, b.max_seqlen, labels=b.labels).lm_loss.item() for b in batches)
    want /= len(batches)
    assert abs(logged - want) <= 1e-6 * abs(want), (logged, want)
    # and the same recipe without init_from_released starts elsewhere (the import was not ignored)
    fresh = new_run(SPARSE_FIRST, name="fresh")
    train(fresh, max_steps=1, progress=False)
    assert abs(train_records(fresh)[1]["lm_loss"] - want) > 1e-3
