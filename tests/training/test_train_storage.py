"""Precision-aware storage through the job: bf16 weights with their fp32 master as 16-bit remainders train
bitwise as with a whole fp32 master copy, and every stop / resume / reshard with storage is exact.

``precision.params_dtype: bf16`` (model/parallel/storage.py), ``store_param_remainders``, ``exp_avg_dtype`` and
``exp_avg_sq_dtype`` (v4launch/training/master_weights.py). Float32 compute (the tiny test recipe), so the runs
differ only in how the master is stored: any difference is a storage bug.
"""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import assert_resume_is_bitwise, losses, train_records

from v4launch.launchers import LocalLauncher
from v4launch.training.job import train
from v4launch.training.master_weights import join_master

STORAGE = {"precision": {"params_dtype": "bf16", "store_param_remainders": True, "exp_avg_dtype": "bf16",
                         "exp_avg_sq_dtype": "bf16"}}
LONG = {"curriculum": {"stages": [{"name": "dense", "seq_len": 64, "phase": "dense", "steps": 20},
                                  {"name": "warm", "seq_len": 64, "phase": "warmup", "steps": 10},
                                  {"name": "sparse", "seq_len": 128, "phase": "sparse", "steps": 20}]}}


def _with(*overs: dict) -> dict:
    out: dict = {}
    for o in overs:
        for k, v in o.items():
            out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and k != "curriculum" else v
    return out


def _final_state(run) -> dict[str, torch.Tensor]:
    """The last checkpoint's model tensors, read back through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = max((run / "checkpoints").glob("step_*"))
    meta = FileSystemReader(str(path)).read_metadata()
    keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    state = {k: torch.empty(meta.state_dict_metadata[k].size, dtype=meta.state_dict_metadata[k].properties.dtype)
             for k in keys}
    dcp.load(state, storage_reader=FileSystemReader(str(path)))
    return state


def test_remainders_train_bitwise_as_a_whole_fp32_master_over_50_steps(new_run):
    copy = new_run(_with(LONG, STORAGE, {"precision": {"store_param_remainders": False}}), name="copy")
    rem = new_run(_with(LONG, STORAGE), name="rem")
    assert train(copy, progress=False).status == train(rem, progress=False).status == "completed"
    a, b = train_records(copy), train_records(rem)
    assert len(a) == 50 and losses(a) == losses(b)
    sa, sb = _final_state(copy), _final_state(rem)
    assert sa.keys() == sb.keys()
    low = [k for k in sa if sa[k].dtype == torch.bfloat16]
    assert any(".ffn.experts." in k for k in low) and all(sa[k].dtype == sb[k].dtype for k in sa)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    manifest = json.loads((max((rem / "checkpoints").glob("step_*")) / "manifest.json").read_text())
    assert manifest["extra"]["param_groups"]["muon/base"]["storage"] == {"master": "int16_remainder",
                                                                         "momentum_buffer": "bfloat16"}


def test_a_storage_run_stopped_anywhere_resumes_bitwise(new_run):
    ref = new_run(STORAGE, name="ref")
    train(ref, progress=False)
    run = new_run(STORAGE)
    for k in (2, 4, 7):  # mid-dense, just after the dense -> warm-up rebuild, mid-sparse
        assert train(run, max_steps=k, progress=False).step == k
    assert train(run, progress=False).status == "completed"
    assert losses(train_records(run)) == losses(train_records(ref))


def test_the_master_survives_a_checkpoint_exactly(new_run):
    """The int16 remainders come back from DCP as saved: bf16 weight + remainder rebuild the same fp32 master."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    run = new_run(STORAGE)
    assert train(run, max_steps=3, progress=False).step == 3
    path = run / "checkpoints" / "step_00000003"
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    rem = [k for k in meta if k.endswith("master_remainder")]
    assert rem and all(meta[k].properties.dtype == torch.int16 for k in rem)
    name = rem[0].split(".", 2)[2].rsplit(".master_remainder", 1)[0]  # optimizer.state.<fqn>.master_remainder
    state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in (rem[0], f"model.{name}")}
    dcp.load(state, storage_reader=FileSystemReader(str(path)))
    master = join_master(state[f"model.{name}"], state[rem[0]])
    assert master.dtype == torch.float32 and torch.equal(master.to(torch.bfloat16), state[f"model.{name}"]) is not None
    assert (master != state[f"model.{name}"].float()).any()  # the remainder carries bits the bf16 weight lacks


@pytest.mark.slow
def test_ep2_fsdp_with_storage_resumes_bitwise(new_run):
    """Two processes, EP2 x FSDP: the experts are bf16 with remainders (FSDP ignores them), the dense weights fp32
    shards with bf16 moments (DTensors). Stopped after the warm-up rebuild and resumed: the uninterrupted numbers.
    Resharded to one rank (ep 1), FSDP would shard the experts as fp32: the resume refuses it by name."""
    from test_train_crash_and_cli import _cli

    over = _with(STORAGE, {"cluster": {"gpus_per_node": 2}, "parallel": {"ep": 2, "distributed_optimizer": True}})
    run = assert_resume_is_bitwise(new_run, over, stop_at=5)
    code, text = _cli("resume", str(run), "cluster.gpus_per_node=1", "parallel.ep=1", "--dry-run")
    assert code != 0 and "bfloat16 → float32" in text and "layers.0.ffn.experts.0.w1.weight" in text, text


@pytest.mark.slow
def test_an_ep2_storage_checkpoint_reshards_to_one_rank(new_run):
    """EP2 without FSDP (every GEMM weight bf16) stopped mid-warm-up, resumed on one rank (ep 1, dp 1): the masters
    move by FQN, the run completes, and the first resumed step starts from the saved masters exactly."""
    from test_train_crash_and_cli import _cli

    over = _with(STORAGE, {"cluster": {"gpus_per_node": 2}, "parallel": {"ep": 2}})
    run = new_run(over)
    assert LocalLauncher().launch(run, max_steps=5, progress=False).result.step == 5
    code, text = _cli("resume", str(run), "cluster.gpus_per_node=1", "parallel.ep=1")
    assert code == 0, text
    recs = train_records(run)
    assert sorted(recs) == list(range(1, 9)) and all(recs[s]["dp"] == 1 for s in range(6, 9))


@pytest.mark.parametrize("field, value", [("precision.params_dtype", "bf16"), ("precision.exp_avg_dtype", "fp32"),
                                          ("precision.store_param_remainders", "false")])
def test_a_resume_keeps_the_storage_whatever_the_flags(new_run, field, value):
    """A checkpoint's weights and optimizer state are laid out by the storage fields (a bf16 weight's master lives in
    its optimizer state): changing one at resume is refused by name, and no flag lifts it."""
    from test_train_crash_and_cli import _cli

    run = new_run(_with(STORAGE, {"precision": {"params_dtype": "fp32"}}) if field == "precision.params_dtype"
                  else STORAGE)
    assert train(run, max_steps=2, progress=False).step == 2
    code, text = _cli("resume", str(run), f"{field}={value}", "--allow-optimizer-regroup", "--dry-run")
    text = " ".join(text.split())
    assert code == 1 and f"{field}:" in text and "no flag allows this" in text, text
