"""Tokenizes documents into Megatron indexed datasets (PREFIX_{key}_document.bin/.idx)."""

import argparse
import collections
import itertools
import logging
import multiprocessing
import multiprocessing.pool
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from tqdm import tqdm

from data_prep.records import SkippedRecords, iter_documents
from megatron_ext.data.tokenization_record import (
    DEFAULT_CONVENTION,
    RECORD_SUFFIX,
    Convention,
    TokenizationRecord,
    includes_special_tokens,
    write_record,
)
from megatron_ext.data.tokenizer import TOKENIZER_TYPES, Tokenizer, load_tokenizer
from megatron_ext.data.tokenizer import tokenizer_type as tokenizer_type_of
from megatron_ext.errors import EXIT_STORAGE, STORAGE_ERRNOS, BadRecordError, TokenizerError
from megatron_ext.resilience.process_guard import die_with_parent

logger = logging.getLogger(__name__)

Batch = list[dict[str, str]]
# Per key: (all token ids of the batch concatenated, per-document lengths). Flat arrays pickle
# far cheaper between processes than lists of lists.
EncodedBatch = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass
class PreprocessResult:
    prefixes: list[str]  # dataset prefixes to hand to training (path without .bin/.idx)
    documents: int
    tokens: int
    seconds: float
    skipped: SkippedRecords = field(default_factory=SkippedRecords)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron-LM tools/preprocess_data.py naming (document level, no sentence splitting)."""
    return f"{output_prefix}_{key}_document"


# Worker-process state, set once per process by _init_worker.
_tokenizer: Tokenizer | None = None
_append_eod = False


def _init_worker(model_path: str, tokenizer_type: str | None, append_eod: bool, include_special_tokens: bool) -> None:
    global _tokenizer, _append_eod
    # One core per worker: `tokenizers`' batch encode would otherwise run a thread per core in every worker, and
    # the workers' thread pools would share the cores instead of adding to them (docs/data.md, measured).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _tokenizer, _append_eod = load_tokenizer(model_path, tokenizer_type, include_special_tokens), append_eod
    # Ctrl-C is handled once, by the parent, which then tears the pool down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A killed parent cannot tear it down: without this the workers would wait on their task queue forever.
    die_with_parent()


def _encode_batch(batch: Batch) -> EncodedBatch:
    encoded = {}
    for key in batch[0]:
        docs = _tokenizer.tokenize_batch([fields[key] for fields in batch])
        if _append_eod:
            # As Megatron-LM's Encoder.encode: EOD only after a non-empty document
            # (`if len(doc_ids) > 0 and append_eod`), so an empty text stays empty.
            docs = [ids + [_tokenizer.eod] if ids else ids for ids in docs]
        lengths = np.fromiter((len(ids) for ids in docs), dtype=np.int64, count=len(docs))
        encoded[key] = (np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int32,
                                    count=int(lengths.sum())), lengths)
    return encoded


def _batches(docs: Iterator, size: int) -> Iterator[Batch]:
    while batch := [doc.fields for doc in itertools.islice(docs, size)]:
        yield batch


def _encode_in_order(pool: multiprocessing.pool.Pool, batches: Iterator[Batch],
                     max_in_flight: int) -> Iterator[EncodedBatch]:
    """Yield encoded batches in input order, whatever the worker count.

    Pool.imap would keep the order too, but its feeder thread drains the whole input up front;
    a bounded queue of apply_async results keeps memory at max_in_flight batches.
    """
    pending = collections.deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_batch, (batch,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def preprocess(
    inputs: list[str],
    output_prefix: str,
    tokenizer_model: str,
    json_keys: list[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    skip_bad_records: bool = False,
    chunk_docs: int = 256,
    tokenizer_type: str | None = None,
    convention: Convention = DEFAULT_CONVENTION,
) -> PreprocessResult:
    """Write one .bin/.idx pair per json key, and how it was tokenized beside it (PREFIX.tokenization.json); on any
    failure no new pair is left behind. `tokenizer_type`: Megatron-LM's name (GPTSentencePieceTokenizer,
    HuggingFaceTokenizer), None = from the path; `convention`: which of Megatron-LM's flags the tokenization
    follows (megatron_ext.data.tokenization_record)."""
    start = time.perf_counter()
    json_keys = list(json_keys)
    include_special_tokens = includes_special_tokens(convention)
    tokenizer = load_tokenizer(tokenizer_model, tokenizer_type, include_special_tokens)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    bos = getattr(tokenizer, "bos", None)
    record = TokenizationRecord(tokenizer_type_of(tokenizer_model, tokenizer_type), str(tokenizer_model), convention,
                                append_eod, begins_with_bos=bos is not None and tokenizer.tokenize("a")[:1] == [bos])
    prefixes = dict(zip(json_keys, (output_prefix_for(output_prefix, key) for key in json_keys)))
    tmp = f".tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builders: dict[str, IndexedDatasetBuilder] = {}
    skipped = SkippedRecords()
    documents = tokens = 0
    try:
        for key, prefix in prefixes.items():
            builders[key] = IndexedDatasetBuilder(f"{prefix}.bin{tmp}", dtype=dtype)
        docs = iter_documents(inputs, json_keys, skip_bad_records, skipped)
        with (multiprocessing.Pool(workers, _init_worker,
                                   (tokenizer_model, tokenizer_type, append_eod, include_special_tokens)) as pool,
              tqdm(unit="doc", desc="tokenize", disable=None) as bar):
            for batch in _encode_in_order(pool, _batches(docs, chunk_docs), 2 * workers):
                for key, (ids, lengths) in batch.items():
                    builder, offset = builders[key], 0
                    for n in lengths.tolist():
                        # Megatron-LM adds every document, empty ones too, as one "sentence" of
                        # n tokens; an empty document has no sentences, i.e. add_document([], []).
                        builder.add_document(ids[offset:offset + n], [n] if n else [])
                        offset += n
                    tokens += offset
                documents += len(lengths)
                bar.update(len(lengths))
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        for key, prefix in prefixes.items():
            builders[key].finalize(f"{prefix}.idx{tmp}")
            write_record(Path(f"{prefix}{RECORD_SUFFIX}{tmp}"), record)
        for prefix in prefixes.values():
            _publish(prefix, tmp)
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()  # finalize may not have run; the builder owns the handle
        for prefix in prefixes.values():
            for path in (f"{prefix}.bin{tmp}", f"{prefix}.idx{tmp}", f"{prefix}{RECORD_SUFFIX}{tmp}"):
                if os.path.exists(path):
                    os.remove(path)
        raise
    return PreprocessResult(list(prefixes.values()), documents, tokens, time.perf_counter() - start, skipped)


def _publish(prefix: str, tmp: str) -> None:
    # Drop any old .idx first and move the new one last, so a crash in between leaves a .bin
    # without .idx (unloadable) rather than a new .bin paired with a stale .idx.
    if os.path.exists(f"{prefix}.idx"):
        os.remove(f"{prefix}.idx")
    record = f"{prefix}{RECORD_SUFFIX}"
    if os.path.exists(record + tmp):
        os.replace(record + tmp, record)
    elif os.path.exists(record):  # it described the data being replaced
        os.remove(record)
    os.replace(f"{prefix}.bin{tmp}", f"{prefix}.bin")
    os.replace(f"{prefix}.idx{tmp}", f"{prefix}.idx")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, help="files or globs (.jsonl, .jsonl.gz, .txt, .parquet)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    parser.add_argument("--tokenizer-model", required=True,
                        help="a sentencepiece .model, or a Hugging Face tokenizer directory (tokenizer.json)")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                        help="Megatron-LM's name for it (default: from --tokenizer-model: a directory is "
                             "HuggingFaceTokenizer, a file GPTSentencePieceTokenizer)")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--append-eod", action="store_true", help="append the EOS id to every non-empty document")
    special = parser.add_mutually_exclusive_group()  # Megatron-LM's flags; without either, its default
    special.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                         help="Hugging Face tokenizer: no special tokens (Megatron-LM 0.16's default); by default "
                              "what its post-processor adds (Llama 3: BOS on every document), as Megatron-LM's "
                              "default since 0.17")
    special.add_argument("--legacy-tokenizer", action="store_true",
                         help="Megatron-LM's legacy tokenizer: for a Hugging Face tokenizer, with special tokens")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--skip-bad-records", action="store_true",
                        help="skip and count malformed records instead of stopping at the first")
    parser.add_argument("--chunk-docs", type=int, default=256, help="documents per worker task")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.workers < 1 or args.chunk_docs < 1:
        parser.error("--workers and --chunk-docs must be >= 1")
    try:
        load_tokenizer(args.tokenizer_model, args.tokenizer_type)
    except TokenizerError as e:
        parser.error(f"--tokenizer-model {e}")
    try:
        result = preprocess(args.input, args.output_prefix, args.tokenizer_model, args.json_keys,
                            args.append_eod, args.workers, args.skip_bad_records, args.chunk_docs,
                            args.tokenizer_type, "legacy" if args.legacy_tokenizer else
                            "no-include-special-tokens" if args.tokenizer_hf_no_include_special_tokens
                            else DEFAULT_CONVENTION)
    except BadRecordError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: no output written")
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        print(f"storage error: {e.filename or args.output_prefix}: {e.strerror}: free space or choose another "
              "--output-prefix; no output written (temporary files removed)", file=sys.stderr)
        sys.exit(EXIT_STORAGE)
    logger.info(
        "tokenized %d documents into %d tokens in %.1fs (%.0f tokens/s); skipped bad records: %s",
        result.documents, result.tokens, result.seconds, result.tokens / max(result.seconds, 1e-9),
        result.skipped.summary(),
    )
    for prefix in result.prefixes:
        logger.info("wrote %s.bin/.idx  (data path for training: %s)", prefix, prefix)


if __name__ == "__main__":
    main()
