"""Stage specs from parallel.pp_layout and the cut of a model into stages (no processes)."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import tiny_args
from v4launch.model import V4Model
from v4launch.model.parallel.pipeline import cut_stage, local_specs, stage_specs


def test_virtual_stage_i_runs_on_rank_i_mod_pp_with_global_layer_ids():
    specs = stage_specs("Et|t|t|tmL", pp=2, vpp=2, n_layers=4, n_mtp_layers=1)
    assert [(s.pp_rank, s.layer_ids) for s in specs] == [(0, (0,)), (1, (1,)), (0, (2,)), (1, (3,))]
    assert specs[0].has_embed and specs[3].has_mtp and specs[3].has_loss and not specs[1].has_loss
    assert [s.index for s in local_specs(specs, 1)] == [1, 3]


@pytest.mark.parametrize("layout,match", [("Ett|tt|mL", "stages but parallel.pp"), ("Ett|tmtL", "after every decoder"),
                                          ("Ett|tt", "loss 'L' must appear")])
def test_bad_layouts_are_refused_with_the_field_and_a_fix(layout, match):
    with pytest.raises(ValueError, match=match) as err:
        stage_specs(layout, pp=2, vpp=1, n_layers=4, n_mtp_layers=1)
    assert "parallel.pp_layout" in str(err.value) and "Fix:" in str(err.value)


def test_mtp_apart_from_the_loss_stage_is_refused():
    with pytest.raises(ValueError, match="last virtual stage, with 'L'"):
        stage_specs("Et|tttm|L", pp=3, vpp=1, n_layers=4, n_mtp_layers=1)


def test_stages_share_the_models_parameters_under_their_single_device_names():
    model = V4Model(tiny_args(), "warmup")
    specs = stage_specs("Ett|ttmL", pp=2, vpp=1, n_layers=4, n_mtp_layers=1)
    parts = [cut_stage(model, s) for s in specs]
    full = dict(model.named_parameters())
    names = [dict(p.named_parameters()) for p in parts]
    assert sorted([*names[0], *names[1]]) == sorted(full)
    assert not set(names[0]) & set(names[1])
    assert all(p is full[n] for d in names for n, p in d.items())
    assert parts[0].head is None and parts[1].embed is None and "layers.2.attn.wq_a.weight" in names[1]
    parts[1].to(torch.float64)  # a cut moves like a model (shared modules move with it)
    assert model.layers[3].attn.wq_a.weight.dtype == torch.float64


def test_the_seam_is_the_identity_at_pp_1():
    from v4launch.model.parallel.parallelize import ParallelDims, ParallelGroups, parallelize

    model = V4Model(tiny_args(), "dense")
    pm = parallelize(model, ParallelDims(), ParallelGroups(), torch.device("cpu"))
    assert pm.model is model and pm.parts == [model] and pm.pipeline is None
    assert not pm.sharded and not pm.experts
    pm.set_phase("warmup")
    assert model.phase == "warmup" and model.has_indexer
    other = parallelize(V4Model(tiny_args(), "dense"), ParallelDims(), ParallelGroups(), torch.device("cpu"),
                        phase="sparse")
    assert other.model.phase == "sparse" and other.model.has_indexer
