"""Builds the embedded default dataset (stdlib corpus, tokenizer, .bin/.idx); skips finished steps."""

import argparse
import logging
import os
import time

from data_prep.corpus import DEFAULT_MAX_BYTES, build_corpus
from data_prep.preprocess import output_prefix_for, preprocess
from data_prep.train_tokenizer import train_tokenizer

logger = logging.getLogger(__name__)


def prepare_default(out_dir: str = "data/tiny", vocab_size: int = 4096,
                    max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Make sure every artifact exists and return the dataset prefix to train on."""
    corpus = os.path.join(out_dir, "stdlib.jsonl")
    tokenizer = os.path.join(out_dir, "tokenizer")
    dataset = os.path.join(out_dir, "stdlib")
    prefix = output_prefix_for(dataset, "text")
    # A rebuilt step invalidates everything after it, even if those outputs exist.
    stale = not os.path.exists(corpus)
    if stale:
        r = build_corpus(corpus, max_bytes)
        logger.info("corpus: %d files, %d bytes -> %s (%.1fs)", r.files, r.text_bytes, corpus, r.seconds)
    else:
        logger.info("corpus: %s exists, kept", corpus)
    stale = stale or not all(os.path.exists(f"{tokenizer}.{ext}") for ext in ("model", "vocab"))
    if stale:
        r = train_tokenizer([corpus], vocab_size, "bpe", tokenizer)
        logger.info("tokenizer: bpe vocab %d -> %s (%.1fs)", vocab_size, r.model_path, r.seconds)
    else:
        logger.info("tokenizer: %s.model exists, kept", tokenizer)
    stale = stale or not all(os.path.exists(f"{prefix}.{ext}") for ext in ("bin", "idx"))
    if stale:
        r = preprocess([corpus], dataset, f"{tokenizer}.model", ["text"], append_eod=True, workers=2)
        logger.info("dataset: %d documents, %d tokens -> %s.bin/.idx (%.1fs)",
                    r.documents, r.tokens, prefix, r.seconds)
    else:
        logger.info("dataset: %s.bin/.idx exist, kept", prefix)
    return prefix


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default="data/tiny")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    prefix = prepare_default(args.out_dir, args.vocab_size, args.max_bytes)
    logger.info("default dataset ready in %.1fs; tokenizer %s; data path:",
                time.perf_counter() - start, os.path.join(args.out_dir, "tokenizer.model"))
    # The prefix alone on stdout, so scripts can capture it: PREFIX=$(python -m data_prep.prepare_default)
    print(prefix, flush=True)


if __name__ == "__main__":
    main()
