"""Blends of existing megatron-core prefixes: checks at preparation, weighted deterministic sampling, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from v4launch.data import ByteTokenizer, DataError, prepare_dataset
from v4launch.data.blend import BlendedBatchLoader
from v4launch.data.indexed import megatron_indexed
from v4launch.validators.schema import DataConfig


def _blend(tmp_path, make_dataset, weights=(3.0, 1.0), n_docs=(30, 12), fraction=0.0, seed=0):
    rng = np.random.default_rng(seed)
    prefixes = [make_dataset([int(x) for x in rng.integers(5, 60, size=n)], seed=seed + i)[0]
                for i, n in enumerate(n_docs)]
    cfg = DataConfig(source="blend", blend=tuple({"weight": w, "prefix": str(p)} for w, p in zip(weights, prefixes)),
                     validation_fraction=fraction)
    ds = prepare_dataset(cfg, ByteTokenizer(), out_prefix=tmp_path / "meta" / "blend")
    return ds, prefixes


def test_blend_samples_by_weight_and_reads_each_prefixes_own_tokens(tmp_path, make_dataset):
    ds, prefixes = _blend(tmp_path, make_dataset)
    assert ds.num_documents == 42 and [s["weight"] for s in ds.sources] == [0.75, 0.25]
    loader = BlendedBatchLoader(ds, seq_len=64, seed=11, dp_rank=0, dp_size=1)
    order = np.concatenate([loader._order(e) for e in range(3)])  # three blend epochs of 42 draws
    src = (order >= 30).astype(int)
    assert [int((src[e * 42:(e + 1) * 42] == 1).sum()) for e in range(3)] == [round(0.25 * 42)] * 3  # 10.5 -> 11
    for start in range(0, 126 - 8, 8):  # every stretch of 8 draws follows 3:1 within one draw
        assert abs(int((src[start:start + 8] == 1).sum()) - 2) <= 1
    # the small prefix (12 documents, 11 draws per epoch) walks a full shuffle before repeating a document
    small = order[src == 1][:12] - 30
    assert sorted(small.tolist()) == list(range(12))
    # the packed rows hold the prefixes' own documents (one row per batch: real segments first, then padding)
    sets = [megatron_indexed().IndexedDataset(str(p)) for p in prefixes]
    for _ in range(6):
        batch, t = next(loader), 0
        for (_, doc, off, n) in batch.segments:
            s = int(doc >= 30)
            local = int(loader._docs.doc_ids[s][doc - loader._docs.offsets[s]])
            assert batch.tokens[t:t + n].tolist() == sets[s].get(local)[off:off + n].astype(np.int64).tolist()
            t += n


def test_blend_is_deterministic_and_resumes_at_another_dp_size(tmp_path, make_dataset):
    ds, _ = _blend(tmp_path, make_dataset, weights=(1.0, 2.0), n_docs=(20, 25), seed=4)
    a = BlendedBatchLoader(ds, seq_len=48, seed=3, dp_rank=0, dp_size=1)
    b = BlendedBatchLoader(ds, seq_len=48, seed=3, dp_rank=0, dp_size=1)
    first = [next(a).tokens.tolist() for _ in range(5)]
    assert first == [next(b).tokens.tolist() for _ in range(5)]
    other = BlendedBatchLoader(ds, seq_len=48, seed=4, dp_rank=0, dp_size=1)
    assert [next(other).tokens.tolist() for _ in range(5)] != first
    rest = [next(a).tokens.tolist() for _ in range(4)]  # global batches 5..8 on one rank
    state = b.state_dict()
    assert state["dataset"] == ds.key and state["num_docs"] == 45
    r0 = BlendedBatchLoader(ds, seq_len=48, seed=3, dp_rank=0, dp_size=2)
    r1 = BlendedBatchLoader(ds, seq_len=48, seed=3, dp_rank=1, dp_size=2)
    r0.load_state_dict(state)
    r1.load_state_dict(state)
    resumed = []
    for _ in range(2):
        resumed += [next(r0).tokens.tolist(), next(r1).tokens.tolist()]
    assert resumed == rest


def test_blend_preparation_refuses_foreign_ids_tokenizers_and_missing_files(tmp_path, make_dataset):
    prefix = tmp_path / "big" / "doc"
    prefix.parent.mkdir()
    idx = megatron_indexed()
    builder = idx.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in (np.array([1, 2, 3], dtype=np.uint16), np.array([4, 300, 5], dtype=np.uint16)):
        builder.add_document(doc, [doc.size])
    builder.finalize(f"{prefix}.idx")
    cfg = DataConfig(source="blend", blend=({"weight": 1.0, "prefix": str(prefix)},), validation_fraction=0.0)
    with pytest.raises(DataError) as e:
        prepare_dataset(cfg, ByteTokenizer(), out_prefix=tmp_path / "m1")
    assert f"data.blend prefix {prefix}: token id 300 at position 4 is outside the tokenizer's vocabulary 0..256" \
        in e.value.message and "data.tokenizer" in e.value.hint
    ok = make_dataset([10, 12])[0]
    ok.with_name(ok.name + ".json").write_text(json.dumps({"tokenizer": "hf-tokenizer:v1:sha256=ab:vocab=9:eod=1"}))
    cfg = DataConfig(source="blend", blend=({"weight": 1.0, "prefix": str(ok)},), validation_fraction=0.0)
    with pytest.raises(DataError, match="was tokenized with hf-tokenizer:v1:sha256=ab:vocab=9:eod=1, the recipe's "
                                        "data.tokenizer is byte-utf8"):
        prepare_dataset(cfg, ByteTokenizer(), out_prefix=tmp_path / "m2")
    cfg = DataConfig(source="blend", blend=({"weight": 1.0, "prefix": str(tmp_path / "nope")},))
    with pytest.raises(DataError, match=r"nope.bin, .*nope.idx missing"):
        prepare_dataset(cfg, ByteTokenizer(), out_prefix=tmp_path / "m3")
    with pytest.raises(ValidationError, match="set data.source=blend"):
        DataConfig(source="blend")
    with pytest.raises(ValidationError, match="greater than 0"):
        DataConfig(source="blend", blend=({"weight": 0.0, "prefix": str(ok)},))


def test_blend_holds_out_documents_of_every_prefix(tmp_path, make_dataset):
    ds, _ = _blend(tmp_path, make_dataset, n_docs=(20, 10), fraction=0.2)
    assert [s["valid_documents"] for s in ds.sources] == [4, 2] and ds.num_valid_documents == 6
    valid = BlendedBatchLoader(ds, seq_len=256, seed=0, dp_rank=0, dp_size=1, shuffle=False, valid=True)
    train = BlendedBatchLoader(ds, seq_len=256, seed=0, dp_rank=0, dp_size=1)
    held = {(s, int(d)) for s, ids in enumerate(valid._docs.doc_ids) for d in ids}
    trained = {(s, int(d)) for s, ids in enumerate(train._docs.doc_ids) for d in ids}
    assert len(held) == 6 and not held & trained and len(trained) == 24
    assert sum(b.num_docs for b in valid.evaluation_batches()) == 6


def test_a_blend_never_overwrites_the_metadata_of_another_dataset(tmp_path, make_dataset):
    """Prepared again with other weights at the same prefix, the blend is refused and the old P.json is kept;
    the same blend is reused."""
    ds, prefixes = _blend(tmp_path, make_dataset)
    meta = tmp_path / "meta" / "blend.json"
    before = meta.read_text()
    again = prepare_dataset(DataConfig(source="blend", blend=tuple({"weight": w, "prefix": str(p)}
                                                                   for w, p in zip((3.0, 1.0), prefixes)),
                                       validation_fraction=0.0), ByteTokenizer(), out_prefix=tmp_path / "meta" / "blend")
    assert again.reused and again.key == ds.key
    other = DataConfig(source="blend", blend=tuple({"weight": w, "prefix": str(p)} for w, p in zip((1.0, 1.0), prefixes)))
    with pytest.raises(DataError, match="prepared from other inputs"):
        prepare_dataset(other, ByteTokenizer(), out_prefix=tmp_path / "meta" / "blend")
    assert meta.read_text() == before
