"""`v4launch run --max-steps` end to end with a BPE tokenizer trained here on the workspace's text, and with a
blend of two existing megatron-core prefixes."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from train_helpers import train_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from tokenizer_helpers import train_bpe  # noqa: E402

from v4launch.checkpoints import Manifest, latest_checkpoint  # noqa: E402
from v4launch.data import ByteTokenizer, get_tokenizer, prepare_dataset  # noqa: E402
from v4launch.validators.schema import DataConfig  # noqa: E402


def _cli(*args: str):
    from typer.testing import CliRunner

    from v4launch.cli import app

    return CliRunner().invoke(app, list(args))


def test_run_trains_a_few_steps_with_a_bpe_tokenizer(workspace, write_recipe):
    files = sorted(str(p) for p in (workspace / "text").iterdir())
    path = train_bpe(workspace / "tok", files, vocab_size=300)
    recipe = write_recipe("bpe", {"data": {"tokenizer": str(path)}, "model": {"vocab_size": 304}})
    result = _cli("run", str(recipe), "--max-steps", "2", "--no-progress")
    assert result.exit_code == 0, result.output
    run = max((workspace / "runs").iterdir())
    recs = train_records(run)
    assert sorted(recs) == [1, 2] and all(math.isfinite(r["lm_loss"]) for r in recs.values())
    assert recs[1]["lm_loss"] < math.log(304) + 1.0  # a fresh model's loss is about log(vocab)
    fingerprint = get_tokenizer(str(path)).fingerprint()
    assert Manifest.read(latest_checkpoint(run / "checkpoints")).tokenizer == fingerprint
    prefix = json.loads((run / "run.json").read_text())["extra"]["data_prefix"]
    assert json.loads(Path(f"{prefix}.json").read_text())["tokenizer"] == fingerprint
    # a vocabulary larger than the model's is refused by validate before any data is prepared
    small = write_recipe("small", {"data": {"tokenizer": str(path)}, "model": {"vocab_size": 280}})
    refused = _cli("validate", str(small))
    assert refused.exit_code == 1 and "vocab_size 280 < 300" in refused.output


def test_run_trains_on_a_two_prefix_blend(workspace, write_recipe):
    files = sorted((workspace / "text").iterdir())
    prefixes = []
    for i, part in enumerate((files[::2], files[1::2])):
        folder = workspace / f"part{i}"
        folder.mkdir()
        for f in part:
            (folder / f.name).write_text(f.read_text())
        ds = prepare_dataset(DataConfig(source="files", paths=(str(folder),), validation_fraction=0.0), ByteTokenizer(),
                             out_prefix=workspace / "megatron" / f"part{i}")
        prefixes.append(str(ds.train_prefix))
    blend = [{"weight": 2.0, "prefix": prefixes[0]}, {"weight": 1.0, "prefix": prefixes[1]}]
    recipe = write_recipe("blend", {"data": {"source": "blend", "paths": [], "blend": blend,
                                             "validation_fraction": 0.2}})
    result = _cli("run", str(recipe), "--max-steps", "2", "--no-progress")
    assert result.exit_code == 0, result.output
    run = max((workspace / "runs").iterdir())
    recs = train_records(run)
    assert sorted(recs) == [1, 2] and all(math.isfinite(r["lm_loss"]) for r in recs.values())
    meta = json.loads(Path(json.loads((run / "run.json").read_text())["extra"]["data_prefix"] + ".json").read_text())
    assert meta["kind"] == "blend" and [s["weight"] for s in meta["sources"]] == [2 / 3, 1 / 3]
    assert all(s["tokenizer"] == ByteTokenizer().fingerprint() for s in meta["sources"])
    assert Manifest.read(latest_checkpoint(run / "checkpoints")).tokenizer == ByteTokenizer().fingerprint()
