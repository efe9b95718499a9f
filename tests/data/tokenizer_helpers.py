"""A byte-level BPE tokenizer trained on local text with the ``tokenizers`` library (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def train_bpe(folder: Path, files: list[str], vocab_size: int = 320) -> Path:
    """A byte-level BPE tokenizer trained on ``files`` with ``<eod>`` as its end-of-document token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eod>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eod>"}}))
    return folder / "tokenizer.json"
