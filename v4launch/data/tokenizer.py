"""Tokenizers of ``data.tokenizer``: the byte tokenizer, or a Hugging Face ``tokenizer.json``.

``byte``: UTF-8 bytes 0..255 plus one end-of-document id (256), vocab 257. Needs no files or
downloads, so every machine tokenizes the same way; the model's ``vocab_size`` may be larger
(tiny_cpu.yaml rounds up to 264).

A path ending in ``.json``: a Hugging Face ``tokenizer.json`` read with the ``tokenizers`` library
(e.g. the one shipped with the released V4 checkpoint). Its end-of-document id is the
``eos_token`` of the ``tokenizer_config.json`` beside it (the Hugging Face convention); without
one the tokenizer is refused rather than guessed. Both kinds have a ``fingerprint()`` that goes
into the dataset metadata, the data cache key and every checkpoint manifest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .sources import DataError


class ByteTokenizer:
    """UTF-8 bytes → ids 0..255; ``eod_id`` = 256 marks the end of a document."""

    eod_id: int = 256
    vocab_size: int = 257
    name: str = "byte"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids (no EOD appended). Length = UTF-8 byte count."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as a uint16 array [n_bytes] (fast path used by dataset preparation)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: EOD ids are dropped, invalid UTF-8 is replaced (U+FFFD).

        Raises:
            ValueError: an id outside 0..256.
        """
        data = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eod_id:
                continue
            if not 0 <= i < 256:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary 0..{self.eod_id}")
            data.append(i)
        return data.decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        """Stable identity of kind + vocabulary (stored in dataset metadata and checkpoint manifests)."""
        return f"byte-utf8:v1:vocab={self.vocab_size}:eod={self.eod_id}"


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (``tokenizers.Tokenizer``), ids as the file defines them.

    Args:
        path: the tokenizer.json file; its ``tokenizer_config.json`` sibling names the ``eos_token``
            used as end of document.

    Attributes: ``eod_id`` (id of the eos token), ``vocab_size`` (largest id + 1, added tokens
    included), ``name`` (the path as given), ``sha256`` (of the file's bytes).

    Raises:
        DataError: the file is missing or not a tokenizer.json, or no eos_token names a token of it.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.name, self.path = str(path), Path(path).expanduser()
        try:
            data = self.path.read_bytes()
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # OSError, UnicodeDecodeError, or the plain Exception tokenizers raises
            raise DataError(f"data.tokenizer={self.name}: cannot be read as a Hugging Face tokenizer.json ({exc})",
                            hint="give the path of a tokenizer.json (or `byte`)") from None
        self.sha256 = hashlib.sha256(data).hexdigest()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        eos = _eos_token(self.path.with_name("tokenizer_config.json"), self.name)
        if eos not in vocab:
            raise DataError(f"data.tokenizer={self.name}: the eos_token {eos!r} of tokenizer_config.json is not a "
                            "token of the tokenizer", hint="set eos_token to the tokenizer's end-of-document token")
        self.eod_id = int(vocab[eos])

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added, no EOD)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int64 array (dataset preparation casts it to the dataset's dtype)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens such as the EOD are dropped)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def fingerprint(self) -> str:
        """Identity of the exact file (sha256 of its bytes), its vocabulary size and EOD id."""
        return f"hf-tokenizer:v1:sha256={self.sha256[:16]}:vocab={self.vocab_size}:eod={self.eod_id}"


def _eos_token(config: Path, name: str) -> str:
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except FileNotFoundError:
        raise DataError(f"data.tokenizer={name}: no tokenizer_config.json beside it to name the end-of-document "
                        "token", hint=f'write {config} with {{"eos_token": "<the end-of-document token>"}}') from None
    except (OSError, ValueError, AttributeError) as exc:
        raise DataError(f"{config}: cannot be read ({exc})", hint="restore the tokenizer's tokenizer_config.json") from None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str) or not eos:
        raise DataError(f"{config}: has no eos_token (the end-of-document token)",
                        hint='add "eos_token": "<the end-of-document token>"')
    return eos


def get_tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer named by ``data.tokenizer``: ``byte``, or the path of a tokenizer.json.

    Raises:
        ValueError: a name that is neither ``byte`` nor a path ending in ``.json``.
        DataError: an unreadable tokenizer.json (see :class:`HFTokenizer`).
    """
    if name == "byte":
        return ByteTokenizer()
    if name.endswith(".json"):
        return HFTokenizer(name)
    raise ValueError(f"data.tokenizer={name!r}: unknown tokenizer; use 'byte' or the path of a Hugging Face "
                     "tokenizer.json")
