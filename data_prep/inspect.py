"""Summarises a Megatron indexed dataset (PREFIX.bin/.idx): sizes, document lengths, decoded samples."""

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

from megatron_ext.data.datasets import max_token_id
from megatron_ext.data.tokenization_record import RECORD_SUFFIX, read_record
from megatron_ext.errors import DatasetError

HISTOGRAM_WIDTH = 40


@dataclass
class DatasetStats:
    prefix: str
    dtype: str
    documents: int
    sequences: int
    tokens: int
    bin_bytes: int
    doc_lengths: np.ndarray  # tokens per document, int64


def normalize_prefix(path: str) -> str:
    """Accept PREFIX, PREFIX.bin or PREFIX.idx (so shell globs like shards/*.idx work)."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def check_prefix(prefix: str) -> None:
    """Raise DatasetError naming the missing file, with a hint when a likely prefix exists instead."""
    for suffix in (".bin", ".idx"):
        path = prefix + suffix
        if os.path.isfile(path):
            continue
        hint = ""
        if os.path.isfile(f"{prefix}_text_document{suffix}"):
            hint = f"; did you mean {prefix}_text_document (preprocess appends _{{key}}_document)?"
        raise DatasetError(f"{path}: no such file (a dataset prefix names PREFIX.bin + PREFIX.idx){hint}")


def open_dataset(prefix: str):
    """megatron-core IndexedDataset for `prefix`, after checking both files exist and agree in size."""
    prefix = normalize_prefix(prefix)
    check_prefix(prefix)  # before the slow megatron import, so a typo fails at once
    import warnings

    with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        ds = IndexedDataset(prefix, mmap=True)
    except (AssertionError, ValueError, KeyError, OSError) as e:
        raise DatasetError(f"{prefix}.idx: not a readable Megatron index ({type(e).__name__}: {e})") from None
    # A .bin cut short (full disk, interrupted copy) loads fine and fails only at a random step of
    # training; the index says exactly how many bytes there must be.
    expected = int(ds.sequence_lengths.sum(dtype=np.int64)) * np.dtype(ds.index.dtype).itemsize
    actual = os.path.getsize(f"{prefix}.bin")
    if actual != expected:
        raise DatasetError(f"{prefix}.bin: {actual} bytes but {prefix}.idx describes {expected}; "
                           "the pair is truncated or mismatched, re-create it")
    return ds


def document_lengths(ds) -> np.ndarray:
    """Tokens per document, from the index alone (no .bin reads)."""
    ends = np.concatenate([[0], np.cumsum(ds.sequence_lengths, dtype=np.int64)])
    return np.diff(ends[ds.document_indices])


def dataset_stats(prefix: str, ds=None) -> DatasetStats:
    """Counts and document lengths of the dataset at `prefix` (opened here unless `ds` is given)."""
    ds = ds if ds is not None else open_dataset(prefix)
    prefix = normalize_prefix(prefix)
    lengths = document_lengths(ds)
    return DatasetStats(prefix, np.dtype(ds.index.dtype).name, len(lengths), len(ds), int(lengths.sum()),
                        os.path.getsize(f"{prefix}.bin"), lengths)


def document_tokens(ds, doc: int) -> np.ndarray:
    first, last = int(ds.document_indices[doc]), int(ds.document_indices[doc + 1])
    if first == last:  # empty document: no sequences (slicing would index past the end)
        return np.zeros(0, dtype=ds.index.dtype)
    return np.concatenate(ds[first:last])


def log2_histogram(lengths: np.ndarray, width: int = HISTOGRAM_WIDTH) -> list[str]:
    """Text histogram of lengths in buckets 0, 1, 2-3, 4-7, ... (one line per bucket up to the max)."""
    if lengths.size == 0:
        return []
    # bucket 0 holds empty documents, bucket b >= 1 holds [2^(b-1), 2^b).
    buckets = np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64) + 1, 0)
    counts = np.bincount(buckets)
    top = counts.max()
    lines = []
    first = 0 if counts[0] else int(np.flatnonzero(counts)[0])  # no run of empty leading buckets
    for b, count in enumerate(counts.tolist()[first:], start=first):
        label = "0" if b == 0 else f"{2 ** (b - 1)}-{2 ** b - 1}" if b > 1 else "1"
        bar = "#" * (round(width * count / top) if count else 0)
        if count and not bar:
            bar = "."  # a non-empty bucket never looks empty
        lines.append(f"  {label:>17} | {bar:<{width}} {count:>10,d} ({100 * count / lengths.size:5.1f}%)")
    return lines


def report(prefix: str, samples: int = 3, tokenizer_model: str | None = None, sample_chars: int = 400) -> str:
    """The text `python -m data_prep.inspect` prints."""
    ds = open_dataset(prefix)
    stats = dataset_stats(prefix, ds)
    lengths = stats.doc_lengths
    lines = [
        f"dataset   {stats.prefix}  (.bin {stats.bin_bytes / 1e6:,.1f} MB)",
        f"documents {stats.documents:,d}  (empty: {int((lengths == 0).sum()):,d})",
        f"sequences {stats.sequences:,d}",
        f"tokens    {stats.tokens:,d}",
        f"dtype     {stats.dtype}  (ids < {np.iinfo(stats.dtype).max + 1:,d})",
    ]
    record = read_record(stats.prefix)
    lines.append(f"tokenized {record.describe()}, with {record.tokenizer}" if record else
                 f"tokenized (no {RECORD_SUFFIX} beside it: written by another tool or an older data_prep)")
    if lengths.size:
        lines.append(f"document length (tokens): min {lengths.min():,d} | mean {lengths.mean():,.1f} | "
                     f"median {np.median(lengths):,.0f} | max {lengths.max():,d}")
        lines += ["document length histogram (tokens, log2 buckets):", *log2_histogram(lengths)]
    tokenizer = None
    if tokenizer_model is not None:
        from megatron_ext.data.tokenizer import load_tokenizer
        from megatron_ext.errors import TokenizerError

        try:
            tokenizer = load_tokenizer(tokenizer_model)
        except TokenizerError as e:
            raise DatasetError(str(e)) from None
        # The costliest mistake here is training with another tokenizer than the one that wrote
        # the data: ids past the vocabulary crash the embedding, smaller ones silently mislead.
        top = max_token_id(ds)
        verdict = "ok" if top < tokenizer.vocab_size else "TOO LARGE: written with a bigger vocabulary"
        lines.append(f"largest token id {top:,d} vs vocabulary {tokenizer.vocab_size:,d} of "
                     f"{tokenizer_model}: {verdict}")
        nonempty = np.flatnonzero(lengths)
        if nonempty.size:
            ends = np.cumsum(lengths)[nonempty] - 1
            last_ids = ds.bin_reader.read(dtype=ds.index.dtype, count=int(lengths.sum()), offset=0)[ends]
            eod_share = float((last_ids == tokenizer.eod).mean())
            lines.append(f"documents ending with EOD (id {tokenizer.eod}): {100 * eod_share:.1f}%"
                         + ("" if eod_share > 0.99 else "  (preprocess without --append-eod?)"))
    if samples > 0 and lengths.size:
        picks = np.unique(np.linspace(0, lengths.size - 1, num=min(samples, lengths.size)).astype(np.int64))
        lines.append(f"samples ({len(picks)} documents, evenly spaced):")
        for doc in picks.tolist():
            ids = document_tokens(ds, doc)
            lines.append(f"--- document {doc:,d}: {ids.size:,d} tokens")
            if tokenizer is not None:
                text = tokenizer.detokenize(ids)
                more = ""
                if len(text) > sample_chars:
                    more = f" ... [{len(text) - sample_chars:,d} more characters]"
                lines.append(text[:sample_chars] + more)
            else:
                shown = " ".join(map(str, ids[:32].tolist()))
                more = " ..." if ids.size > 32 else ""
                lines.append(f"ids: {shown}{more}  (pass --tokenizer-model to decode)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data_prep.inspect", description=__doc__)
    parser.add_argument("prefix", help="dataset prefix (PREFIX.bin + PREFIX.idx; a .bin/.idx path works too)")
    parser.add_argument("--samples", type=int, default=3, help="documents to show (0 = none)")
    parser.add_argument("--tokenizer-model", help="sentencepiece .model or Hugging Face tokenizer directory to "
                                                  "decode samples and check ids with")
    parser.add_argument("--sample-chars", type=int, default=400, help="characters shown per decoded sample")
    args = parser.parse_args(argv)
    try:
        print(report(args.prefix, args.samples, args.tokenizer_model, args.sample_chars), flush=True)
    except DatasetError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
