"""Training data: byte tokenizer, document sources, megatron-core indexed datasets, THD packing.

    tokenizer.py  ByteTokenizer (UTF-8 bytes + EOD, vocab 257)
    sources.py    python_stdlib_documents / file_documents (txt, jsonl, directories)
    prepare.py    prepare_dataset -> PreparedDataset (.bin/.idx via megatron-core, cached, atomic)
    packing.py    PackedBatchLoader -> PackedBatch (fixed-capacity THD, resumable across DP/seq_len)
    blend.py      BlendDataset: weighted prefixes prepared elsewhere, checked against the recipe
    indexed.py    megatron_indexed(): megatron-core's indexed-dataset module, imported on first use

megatron-core is imported lazily (first prepare or loader), never at package import.
Layout and guarantees: docs/data.md.
"""

from .packing import IGNORE_INDEX, PackedBatch, PackedBatchLoader
from .prepare import PreparedDataset, cache_key, default_prefix, prepare_dataset
from .sources import DataError, file_documents, python_stdlib_documents
from .tokenizer import ByteTokenizer, get_tokenizer

__all__ = [
    "IGNORE_INDEX", "PackedBatch", "PackedBatchLoader", "PreparedDataset", "cache_key", "default_prefix",
    "prepare_dataset", "DataError", "file_documents", "python_stdlib_documents", "ByteTokenizer", "get_tokenizer",
]
