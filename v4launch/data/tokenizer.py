"""Byte-level tokenizer: UTF-8 bytes 0..255 plus one end-of-document id (256), vocab 257.

Needs no files or downloads, so every machine tokenizes the same way; the
model's ``vocab_size`` may be larger (tiny_cpu.yaml rounds up to 264).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


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


def get_tokenizer(name: str) -> ByteTokenizer:
    """The tokenizer named by ``data.tokenizer`` (only ``byte`` exists).

    Raises:
        ValueError: an unknown name.
    """
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"data.tokenizer={name!r}: unknown tokenizer; known: ['byte']")
