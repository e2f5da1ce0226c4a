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


def megatron_hf_tokenizer(directory: Path, include_special_tokens: bool):
    """megatron-core's HuggingFaceTokenizer as Megatron-LM core_v0.19's tools/preprocess_data.py builds it: its
    argument defaults (the fast tokenizer, with special tokens), or --tokenizer-hf-no-include-special-tokens (its
    legacy tokenizer is AutoTokenizer itself: tokenize(text) = tokenizer(text).input_ids, eod = eos_token_id)."""
    from argparse import Namespace

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    return build_tokenizer(Namespace(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory), vocab_file=None, merge_file=None,
        special_tokens=None, trust_remote_code=False, chat_template=None, metadata_path=None, pad_vocab_size=False,
        tokenizer_hf_no_use_fast=False, tokenizer_hf_no_include_special_tokens=not include_special_tokens))
