"""check_resume: every refusal, its override, reshard verdicts, and the safe forward phase moves."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import PARALLEL, groups, manifest_for, tiny_dict

from v4launch.checkpoints import CompatReport, Manifest, check_resume, describe_params
from v4launch.validators.schema import Recipe

TOKENIZER = "byte-utf8:v1:vocab=257:eod=256"


def run(manifest, recipe, stage=None, phase=None, parallel=None, tokenizer=TOKENIZER, param_groups=None, allow=()):
    stage = manifest.stage_index if stage is None else stage
    phase = phase or recipe.curriculum.stages[stage].phase
    if param_groups is None:
        param_groups = groups(indexer=phase != "dense")
    return check_resume(manifest, recipe=recipe, target_stage_index=stage, target_phase=phase,
                        parallel_sizes=parallel or PARALLEL, tokenizer_fingerprint=tokenizer,
                        param_groups=param_groups, allow=set(allow))


def item(report: CompatReport, aspect: str):
    (found,) = [i for i in report.items if i.aspect == aspect]
    return found


def with_model(**changes) -> Recipe:
    d = tiny_dict()
    d["model"].update(changes)
    return Recipe.model_validate(d)


def test_same_everything_is_safe(recipe):
    report = run(manifest_for(recipe, 1), recipe)
    assert report.ok and not report.needs_reshard
    assert {i.verdict for i in report.items} == {"safe"}
    json.dumps(report.to_dict())
    assert report.render().row_count == len(report.items)


def test_layer_schedule_change_refused_then_overridden(recipe):
    m = manifest_for(recipe, 1)
    changed = with_model(compress_ratios=[0, 4, 4, 4, 0])
    report = run(m, changed)
    it = item(report, "layer schedule")
    assert not report.ok and it.verdict == "refused" and it.override == "--allow-layer-change" and "compress_ratios" in it.reason
    it = item(run(m, changed, allow={"allow_layer_change"}), "layer schedule")
    assert it.verdict == "safe" and it.overridden and it.label == "safe (overridden)"


def test_phase_regression_refused_then_overridden(recipe):
    m = manifest_for(recipe, 2)  # sparse
    report = run(m, recipe, stage=0)  # back to dense_1k
    assert item(report, "phase").verdict == "refused" and item(report, "stage").verdict == "refused"
    assert item(report, "phase").override == "--allow-phase-regression"
    assert run(m, recipe, stage=0, allow={"--allow-phase-regression", "--allow-optimizer-regroup"}).ok


def test_optimizer_regroup_refused_then_overridden(recipe):
    m = manifest_for(recipe, 1)
    bf16 = groups(indexer=True, dtype=torch.bfloat16)
    it = item(run(m, recipe, param_groups=bf16), "optimizer groups")
    assert it.verdict == "refused" and "float32 → bfloat16" in it.reason and it.override == "--allow-optimizer-regroup"
    moved = groups(indexer=True)
    moved["adamw"] = dict(moved["adamw"], params={**moved["adamw"]["params"], "extra.bias": "float32"})
    assert item(run(m, recipe, param_groups=moved), "optimizer groups").verdict == "refused"
    assert run(m, recipe, param_groups=bf16, allow={"--allow-optimizer-regroup"}).ok


def test_optimizer_groups_compared_by_hash_without_names(recipe):
    def strip(g):
        return {k: {kk: vv for kk, vv in v.items() if kk != "params"} for k, v in g.items()}
    m = manifest_for(recipe, 1, param_groups=strip(groups(indexer=True)))
    assert run(m, recipe, param_groups=strip(groups(indexer=True))).ok
    assert not run(m, recipe, param_groups=strip(groups(indexer=True, dtype=torch.bfloat16))).ok


def test_tokenizer_change_refused_then_overridden(recipe):
    m = manifest_for(recipe, 1)
    it = item(run(m, recipe, tokenizer="sentencepiece:v1:vocab=32000"), "tokenizer")
    assert it.verdict == "refused" and it.override == "--allow-tokenizer-change"
    assert run(m, recipe, tokenizer="other", allow={"--allow-tokenizer-change"}).ok


def test_cold_indexer_refused_for_sparse_but_warmup_is_safe(recipe):
    dense = manifest_for(recipe, 0)
    assert not dense.has_indexer
    to_sparse = run(dense, recipe, stage=2)
    it = item(to_sparse, "indexer")
    assert it.verdict == "refused" and it.override == "--allow-cold-indexer"
    assert run(dense, recipe, stage=2, allow={"--allow-cold-indexer"}).ok
    to_warmup = run(dense, recipe, stage=1)  # indexer params are new: fresh optimizer state, not a regroup
    assert to_warmup.ok and "built" in item(to_warmup, "phase").reason
    assert "new indexer parameters" in item(to_warmup, "optimizer groups").reason
    warm = manifest_for(recipe, 1)
    assert run(warm, recipe, stage=2).ok  # warmup -> sparse


def test_architecture_change_refused_without_override(recipe):
    m = manifest_for(recipe, 1)
    dim = recipe.model.dim
    report = run(m, with_model(dim=2 * dim), allow=set())
    it = item(report, "architecture")
    assert it.verdict == "refused" and it.override is None and f"dim: {dim} → {2 * dim}" in it.reason
    everything = {"--allow-layer-change", "--allow-phase-regression", "--allow-optimizer-regroup",
                  "--allow-tokenizer-change", "--allow-cold-indexer"}
    assert not run(m, with_model(dim=2 * dim), allow=everything).ok
    settings_only = run(m, with_model(init_std=0.01))
    assert settings_only.ok and "init_std" in item(settings_only, "model settings").reason


@pytest.mark.parametrize("key", ["dp", "cp", "world", "pp", "ep"])
def test_parallel_size_changes_are_reshards(recipe, key):
    report = run(manifest_for(recipe, 1), recipe, parallel={**PARALLEL, key: 2})
    assert report.ok and report.needs_reshard and item(report, f"parallel.{key}").verdict == "reshard"


def test_manifest_json_round_trip_and_bad_input(recipe, tmp_path):
    m = manifest_for(recipe, 1)
    assert Manifest.from_dict(json.loads(m.to_json())) == m
    assert m.indexer_layers == (1, 3) and m.layer_ids == (0, 1, 2, 3, 4) and m.n_mtp_layers == 1
    with pytest.raises(ValueError, match="unknown override"):
        run(m, recipe, allow={"--allow-everything"})
    with pytest.raises(ValueError, match="target_phase"):
        run(m, recipe, phase="hybrid")
    from v4launch.checkpoints import CheckpointError
    with pytest.raises(CheckpointError, match="format_version"):
        Manifest.from_dict({**m.to_dict(), "format_version": 99})
    with pytest.raises(CheckpointError, match="unknown"):
        Manifest.from_dict({**m.to_dict(), "surprise": 1})


def test_a_new_indexer_only_group_is_named_not_called_the_same_groups(recipe):
    """dense -> warm-up where the indexer's parameters form a group of their own: safe (fresh state),
    and the report names the new group instead of claiming the groups are the same."""
    dense = manifest_for(recipe, 0)
    new = groups(indexer=False)
    new["indexer"] = describe_params([("layers.1.attn.indexer.wq_b.weight", torch.zeros(2, 2)),
                                      ("layers.1.attn.indexer.weights_proj.weight", torch.zeros(2, 2))])
    it = item(run(dense, recipe, stage=1, param_groups=new), "optimizer groups")
    assert it.verdict == "safe"
    assert "same groups" not in it.reason and "new indexer group indexer" in it.reason
    assert "checkpoint's groups unchanged (adamw, muon)" in it.reason


def test_jumping_past_an_unfinished_stage_says_how_many_steps_it_skips(recipe):
    """--phase/--stage past a stage that was not finished is allowed (a forward move) and the report says what is
    skipped, in steps and tokens; skipping more than a quarter of a warm-up stage is a warning naming the fraction."""
    warm = recipe.curriculum.stages[1]
    assert warm.phase == "warmup" and warm.steps == 40 and recipe.stage_global_batch(warm) * warm.seq_len == 2048
    stage = item(run(manifest_for(recipe, 1, extra={"step_in_stage": 35}), recipe, stage=2), "stage")
    assert stage.verdict == "safe" and "skips 5 steps (10,240 tokens): the last 5 of 40 steps of warmup_512" in stage.reason
    stage = item(run(manifest_for(recipe, 1, extra={"step_in_stage": 10}), recipe, stage=2), "stage")
    assert stage.verdict == "warning" and "skips 30 steps (61,440 tokens): the last 30 of 40 steps of" in stage.reason
    assert "skips 30 of 40 steps (75%) of warm-up stage warmup_512, more than 25%" in stage.reason
    finished = run(manifest_for(recipe, 1, extra={"step_in_stage": warm.steps}), recipe, stage=2)
    assert "skips" not in item(finished, "stage").reason and item(finished, "stage").verdict == "safe"


def test_jumping_from_dense_past_the_whole_warm_up_says_so(recipe):
    """dense → sparse with --allow-cold-indexer: the report names the whole warm-up stage it skips."""
    report = run(manifest_for(recipe, 0, extra={"step_in_stage": 63}), recipe, stage=2, allow={"--allow-cold-indexer"})
    stage = item(report, "stage")
    assert report.ok and stage.verdict == "warning"
    assert "skips 57 steps (116,736 tokens): the last 17 of 80 steps of dense_512, all 40 steps of warmup_512" in stage.reason
    assert "skips 40 of 40 steps (100%) of warm-up stage warmup_512 (all of it)" in stage.reason


def test_the_report_says_where_the_lr_schedule_resumes(recipe):
    """A jump to another stage moves the LR schedule to that stage's first step: the item gives both positions and
    lr values (cosine over the 150-step curriculum, 10 warm-up steps, peak 3e-3, floor 3e-4)."""
    import math

    from v4launch.training.resume import lr_item

    def lr(step):  # the recipe's schedule, written out
        return 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * (step - 10 + 1) / 140))

    mid_warmup = manifest_for(recipe, 1, step=90, extra={"step_in_stage": 10})
    jump = lr_item(recipe, mid_warmup, 2, world=2)
    assert jump.aspect == "lr schedule" and jump.verdict == "applied"
    assert (f"jumps from step 90 (lr {lr(90):.3g}, where the checkpoint left it) to step 120 of 150, lr {lr(120):.3g}"
            in jump.reason) and "optimizer step count continues from 90" in jump.reason
    stay = lr_item(recipe, mid_warmup, 1, world=2)
    assert stay.verdict == "safe" and stay.reason == f"continues at step 90 of 150, lr {lr(90):.3g}"
    at_end = lr_item(recipe, manifest_for(recipe, 1, step=120, extra={"step_in_stage": 40}), 2, world=2)
    assert at_end.verdict == "safe"  # the stage was finished: the next one starts where the schedule is
    recorded = lr_item(recipe, manifest_for(recipe, 1, step=90, extra={"step_in_stage": 10, "next_lr": lr(90)}), 1,
                       world=2)
    assert recorded.verdict == "safe"  # the checkpoint's own lr there: nothing moved
    higher = lr_item(recipe, manifest_for(recipe, 1, step=90, extra={"step_in_stage": 10, "next_lr": lr(90) / 3}), 1,
                     world=2)  # as if the checkpoint's curriculum had been shorter: its cosine was further down
    assert higher.verdict == "warning" and f"had lr {lr(90) / 3:.3g} there" in higher.reason and "x3.00" in higher.reason
    lower = lr_item(recipe, manifest_for(recipe, 1, step=90, extra={"step_in_stage": 10, "next_lr": lr(90) * 2}), 1,
                    world=2)
    assert lower.verdict == "applied" and "lowers it x0.50" in lower.reason
