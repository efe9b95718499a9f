"""A Hugging Face tokenizer.json as data.tokenizer: trained here on local text (nothing downloaded), used to
prepare a megatron-core dataset whose ids and metadata are checked against the ``tokenizers`` library itself."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizer_helpers import train_bpe
from tokenizers import Tokenizer

from v4launch.data import DataError, get_tokenizer, prepare_dataset
from v4launch.data.indexed import megatron_indexed
from v4launch.validators.schema import DataConfig


@pytest.fixture
def texts(tmp_path):
    lib = Path(sysconfig.get_paths()["stdlib"])
    picked = sorted(p for p in lib.glob("*.py") if 3_000 < p.stat().st_size < 9_000)[:8]
    folder = tmp_path / "text"
    folder.mkdir()
    for p in picked:
        (folder / p.name).write_text(p.read_text(encoding="utf-8", errors="replace"))
    return folder


def test_bpe_tokenizer_prepares_a_dataset_of_its_own_ids(tmp_path, texts):
    files = sorted(str(p) for p in texts.iterdir())
    path = train_bpe(tmp_path / "tok", files)
    tok = get_tokenizer(str(path))
    ref = Tokenizer.from_file(str(path))
    assert tok.eod_id == ref.token_to_id("<eod>") and tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    sample = Path(files[0]).read_text()
    assert tok.encode(sample) == ref.encode(sample, add_special_tokens=False).ids
    assert tok.decode(tok.encode(sample)) == sample
    ds = prepare_dataset(DataConfig(source="files", paths=(str(texts),), tokenizer=str(path), validation_fraction=0.0),
                         tok, out_prefix=tmp_path / "data" / "bpe")
    assert ds.tokenizer == tok.fingerprint() and json.loads(Path(f"{ds.prefix}.json").read_text())["tokenizer"] == \
        tok.fingerprint()
    stored = megatron_indexed().IndexedDataset(str(ds.train_prefix))
    texts_in_order = [Path(f).read_text() for f in files]
    assert len(stored) == len(texts_in_order)
    for i, text in enumerate(texts_in_order):
        want = ref.encode(text, add_special_tokens=False).ids + [ref.token_to_id("<eod>")]
        assert stored[i].astype(np.int64).tolist() == want
    assert ds.num_tokens < sum(len(t.encode()) for t in texts_in_order)  # BPE merges: fewer tokens than bytes


def test_fingerprint_follows_the_file_and_a_tokenizer_without_eos_is_refused(tmp_path, texts):
    files = sorted(str(p) for p in texts.iterdir())
    a = get_tokenizer(str(train_bpe(tmp_path / "a", files, 300)))
    b = get_tokenizer(str(train_bpe(tmp_path / "b", files, 340)))
    assert a.fingerprint() != b.fingerprint() and "vocab=300" in a.fingerprint()
    (tmp_path / "a" / "tokenizer_config.json").unlink()
    with pytest.raises(DataError) as e:
        get_tokenizer(str(tmp_path / "a" / "tokenizer.json"))
    assert "no tokenizer_config.json beside it" in e.value.message and '"eos_token"' in e.value.hint
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(DataError, match="eos_token '</s>' of tokenizer_config.json is not a token"):
        get_tokenizer(str(tmp_path / "a" / "tokenizer.json"))
    with pytest.raises(DataError, match="cannot be read as a Hugging Face tokenizer.json"):
        get_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
