"""Megatron-LM core_v0.16.1 tools/preprocess_data.py's document logic (one json key, no sentence splitting,
--append-eod), the reference data_prep.preprocess must reproduce byte for byte."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder


def write_reference(texts: list[str], tokenize: Callable[[str], list[int]], eod: int, vocab_size: int,
                    prefix: Path) -> None:
    """`prefix`.bin/.idx as Megatron-LM writes them with a tokenizer of this tokenize/eod/vocab_size."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(vocab_size))
    for text in texts:
        doc_ids, sentence_lens = [], []
        sentence_ids = tokenize(text)
        if len(sentence_ids) > 0:
            doc_ids.extend(sentence_ids)
            sentence_lens.append(len(sentence_ids))
        if len(doc_ids) > 0:
            doc_ids.append(eod)
            sentence_lens[-1] += 1
        builder.add_document(doc_ids, sentence_lens)
    builder.finalize(f"{prefix}.idx")
