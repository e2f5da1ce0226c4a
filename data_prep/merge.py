"""Merges indexed-dataset shards (PREFIX.bin/.idx) into one dataset, in the order given."""

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from data_prep.inspect import check_prefix, normalize_prefix, open_dataset
from megatron_ext.data.tokenization_record import (
    RECORD_SUFFIX,
    TokenizationRecord,
    mixed_conventions,
    read_record,
    write_record,
)
from megatron_ext.errors import DatasetError

logger = logging.getLogger(__name__)


@dataclass
class MergeResult:
    prefix: str
    shards: int
    documents: int
    tokens: int
    dtype: str
    seconds: float


def _check_names(prefixes: list[str], output_prefix: str) -> None:
    """Cheap checks first: each shard named once, not the output, with both files present."""
    if not prefixes:
        raise DatasetError("no input shards given")
    seen = set()
    for prefix in prefixes:
        if prefix in seen:
            # Usually a glob matching both files of a shard. Silently merging twice would duplicate
            # documents; upsampling belongs in blend weights.
            raise DatasetError(f"{prefix}: given twice (a glob like shards/* matches both .bin and .idx: "
                               "use shards/*.idx; to upsample a shard use blend weights instead)")
        seen.add(prefix)
        if os.path.abspath(prefix) == os.path.abspath(output_prefix):
            raise DatasetError(f"{prefix}: is both an input and --output-prefix; choose another output")
        check_prefix(prefix)  # before the slow megatron import, so a typo fails at once


def _common_dtype(prefixes: list[str]) -> np.dtype:
    """Every shard readable, unbroken and of one dtype; returns that dtype."""
    dtypes = {}
    for prefix in prefixes:
        ds = open_dataset(prefix)
        dtypes[prefix] = np.dtype(ds.index.dtype)
        del ds  # releases the memmaps before the next shard
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p} ({d.name})" for p, d in dtypes.items())
        raise DatasetError(f"shards disagree on dtype: {listing}; they were tokenized with vocabularies of "
                           "different sizes (uint16 below 65,500 ids, int32 above), so they cannot share one "
                           "tokenizer: re-run preprocess on them with the same --tokenizer-model")
    return next(iter(dtypes.values()))


def _common_record(prefixes: list[str]) -> Optional[TokenizationRecord]:
    """The shards' tokenization record when they all have the same one; shards whose documents begin with BOS
    and shards whose do not cannot become one dataset."""
    mixed = mixed_conventions(prefixes)
    if mixed:
        raise DatasetError(mixed.replace("the blend mixes", "the shards mix"))
    records = {read_record(prefix) for prefix in prefixes}
    return records.pop() if len(records) == 1 else None


def merge(inputs: list[str], output_prefix: str) -> MergeResult:
    """Concatenate the shards' documents into output_prefix.bin/.idx; on any failure no pair is left."""
    prefixes = [normalize_prefix(p) for p in inputs]
    _check_names(prefixes, output_prefix)
    import warnings

    with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        from data_prep.preprocess import _publish  # same publish order as preprocess: .idx last

    start = time.perf_counter()
    dtype = _common_dtype(prefixes)
    record = _common_record(prefixes)
    total_bytes = sum(os.path.getsize(f"{p}.bin") for p in prefixes)
    tmp = f".tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = None
    try:
        builder = IndexedDatasetBuilder(f"{output_prefix}.bin{tmp}", dtype=dtype.type)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="merge", disable=None) as bar:
            for prefix in prefixes:
                # add_index appends the shard's index and streams its .bin with shutil.copyfileobj,
                # so memory holds the indices, never the tokens.
                builder.add_index(prefix)
                bar.update(os.path.getsize(f"{prefix}.bin"))
        documents = len(builder.document_indices) - 1
        tokens = int(np.sum(builder.sequence_lengths, dtype=np.int64))
        builder.finalize(f"{output_prefix}.idx{tmp}")
        if record is not None:
            write_record(Path(f"{output_prefix}{RECORD_SUFFIX}{tmp}"), record)
        _publish(output_prefix, tmp)
    except BaseException:
        if builder is not None:
            builder.data_file.close()
        for path in (f"{output_prefix}.bin{tmp}", f"{output_prefix}.idx{tmp}", f"{output_prefix}{RECORD_SUFFIX}{tmp}"):
            if os.path.exists(path):
                os.remove(path)
        raise
    seconds = time.perf_counter() - start
    return MergeResult(output_prefix, len(prefixes), documents, tokens, dtype.name, seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data_prep.merge", description=__doc__)
    parser.add_argument("--input", nargs="+", required=True,
                        help="shard prefixes in merge order (a .bin/.idx path works too, e.g. shards/*.idx)")
    parser.add_argument("--output-prefix", required=True, help="writes OUT.bin and OUT.idx")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # per-file index loading chatter
    try:
        result = merge(args.input, args.output_prefix)
    except DatasetError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: no output written")
    logger.info("merged %d shards: %s documents, %s tokens, %s, in %.1fs", result.shards,
                f"{result.documents:,d}", f"{result.tokens:,d}", result.dtype, result.seconds)
    logger.info("wrote %s.bin/.idx  (data path for training: %s)", result.prefix, result.prefix)


if __name__ == "__main__":
    main()
