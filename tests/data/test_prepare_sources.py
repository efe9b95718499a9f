"""Tokenizer, document sources and dataset preparation (round trip through megatron-core's IndexedDataset)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v4launch.data import ByteTokenizer, DataError, PreparedDataset, file_documents, prepare_dataset, python_stdlib_documents
from v4launch.data.indexed import megatron_indexed
from v4launch.data.sources import stdlib_files
from v4launch.validators.schema import DataConfig
from v4launch.workspace import Workspace

TOK = ByteTokenizer()


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    ids = TOK.encode(text)
    assert len(ids) == len(text.encode()) and all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids + [TOK.eod_id]) == text
    assert TOK.encode_array(text).tolist() == ids


def test_tokenizer_identity():
    assert (TOK.vocab_size, TOK.eod_id) == (257, 256)
    assert TOK.fingerprint() == ByteTokenizer().fingerprint() == "byte-utf8:v1:vocab=257:eod=256"
    with pytest.raises(ValueError, match="257"):
        TOK.decode([257])


def test_stdlib_source_is_real_text():
    files = stdlib_files()
    assert len(files) > 500 and not any("site-packages" in p.parts for p in files)
    total, n = 0, 0
    for text in python_stdlib_documents():
        n += 1
        total += len(text.encode())
        if total > 5_000_000:
            break
    assert total > 5_000_000 and n > 50  # several MB of text are available
    first = next(python_stdlib_documents())
    assert isinstance(first, str) and "\x00" not in first


def test_file_documents_txt_jsonl_and_directories(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("beta")
    (tmp_path / "d" / "sub" / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "x": 1}\n')
    (tmp_path / "d" / ".hidden").write_text("never")
    (tmp_path / "c.md").write_text("gamma ünïcode")
    docs = list(file_documents([tmp_path / "d", tmp_path / "c.md"]))
    assert docs == ["beta", "one", "two", "gamma ünïcode"]


@pytest.mark.parametrize("content, key, match", [
    ('{"text": "ok"}\nnot json\n', "text", r"a\.jsonl:2: not a JSON object"),
    ('{"text": "ok"}\n{"body": "x"}\n', "text", r"a\.jsonl:2: no key 'text'"),
    ('{"text": 5}\n', "text", r"a\.jsonl:1: 'text' holds int"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, key, match):
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        list(file_documents([tmp_path / "a.jsonl"], key))


def test_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(DataError, match="nope.txt does not exist"):
        list(file_documents([tmp_path / "nope.txt"]))
    (tmp_path / "bin.txt").write_bytes(b"line one\n\xff\xfe")
    with pytest.raises(DataError, match=r"bin\.txt:2: not UTF-8"):
        list(file_documents([tmp_path / "bin.txt"]))


def _corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    texts = [f"document {i} " * (i % 7 + 1) if i % 5 else "" for i in range(40)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path, texts


def test_prepare_round_trip_split_entropy(tmp_path):
    path, texts = _corpus(tmp_path)
    cfg = DataConfig(source="files", paths=(str(path),), validation_fraction=0.25)
    ds = prepare_dataset(cfg, TOK, tmp_path / "out" / "p", Workspace(tmp_path))
    nonempty = [t for t in texts if t]
    assert ds.skipped_empty == len(texts) - len(nonempty)
    assert ds.num_valid_documents == math.floor(len(nonempty) * 0.25)
    assert ds.num_documents + ds.num_valid_documents == len(nonempty)
    idx = megatron_indexed()
    train, valid = idx.IndexedDataset(str(ds.train_prefix)), idx.IndexedDataset(str(ds.valid_prefix))
    read = [train[i].tolist() for i in range(len(train))] + [valid[i].tolist() for i in range(len(valid))]
    want = [TOK.encode(t) + [TOK.eod_id] for t in nonempty]
    assert sorted(map(tuple, read)) == sorted(map(tuple, want))
    assert [valid[i].tolist() for i in range(len(valid))] == [want[i] for i in range(len(want)) if (i + 1) % 4 == 0]
    tokens = np.concatenate([train[i] for i in range(len(train))])
    assert ds.num_tokens == tokens.size
    p = np.bincount(tokens) / tokens.size
    p = p[p > 0]
    assert ds.entropy_nats == pytest.approx(float(-(p * np.log(p)).sum()))
    assert ds.entropy_bits == pytest.approx(ds.entropy_nats / math.log(2))
    assert PreparedDataset.read(ds.prefix) == ds


def test_cache_reuse_determinism_and_atomic_layout(tmp_path):
    path, _ = _corpus(tmp_path)
    cfg = DataConfig(source="files", paths=(str(path),), validation_fraction=0.1)
    ws = Workspace(tmp_path / "ws")
    first = prepare_dataset(cfg, TOK, None, ws)
    again = prepare_dataset(cfg, TOK, None, ws)
    assert not first.reused and again.reused and again.prefix == first.prefix
    assert first.prefix.is_relative_to(ws.root / ".v4launch" / "data")
    assert not [p for p in first.prefix.parent.parent.iterdir() if p.name.startswith(".tmp")]
    other = prepare_dataset(cfg, TOK, tmp_path / "explicit" / "p", ws)
    for split in ("train", "valid"):
        for ext in ("bin", "idx"):
            assert Path(f"{first.prefix}.{split}.{ext}").read_bytes() == Path(f"{other.prefix}.{split}.{ext}").read_bytes()
    assert sorted(p.name for p in other.prefix.parent.iterdir()) == ["p.json", "p.train.bin", "p.train.idx", "p.valid.bin", "p.valid.idx"]
    path.write_text(path.read_text() + json.dumps({"text": "a new document"}) + "\n")  # edited input: new key
    with pytest.raises(DataError, match="prepared from other inputs"):
        prepare_dataset(cfg, TOK, tmp_path / "explicit" / "p", ws)
    assert prepare_dataset(cfg, TOK, None, ws).key != first.key


def test_prepare_stdlib_small(tmp_path):
    ds = prepare_dataset(DataConfig(max_documents=12, validation_fraction=0.2), TOK, tmp_path / "s", Workspace(tmp_path))
    assert ds.num_documents + ds.num_valid_documents == 12 and ds.num_valid_documents == 2
    assert ds.num_tokens > 10_000 and 3.0 < ds.entropy_bits < 7.0


def test_prepare_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    with pytest.raises(DataError, match="no non-empty training document"):
        prepare_dataset(DataConfig(source="files", paths=(str(empty),)), TOK, tmp_path / "e", Workspace(tmp_path))
    with pytest.raises(ValueError, match="data.source=files reads the files and directories of data.paths"):
        DataConfig(source="files")  # the schema refuses it (validate); the job's own check stays behind it
    with pytest.raises(DataError, match="data.paths is empty"):
        prepare_dataset(DataConfig.model_construct(source="files", paths=()), TOK, tmp_path / "f", Workspace(tmp_path))
    with pytest.raises(DataError, match="no prepared dataset"):
        PreparedDataset.read(tmp_path / "missing")
