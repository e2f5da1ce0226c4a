"""Trains a deterministic Llama-style sentencepiece tokenizer (byte fallback, code-preserving)."""

import argparse
import io
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import sentencepiece as spm

from data_prep.records import BadRecordError, Document, SkippedRecords, iter_documents

logger = logging.getLogger(__name__)

# sentencepiece silently drops training sentences longer than this many bytes, so we chunk below it.
MAX_SENTENCE_BYTES = 8192
DEFAULT_SAMPLE_BYTES = 100_000_000
SEED = 1234


@dataclass
class TrainResult:
    model_path: str
    vocab_path: str
    vocab_size: int
    documents: int
    sample_bytes: int
    skipped: SkippedRecords
    seconds: float


def chunk_text(text: str, max_bytes: int = MAX_SENTENCE_BYTES) -> Iterator[str]:
    """Split text into pieces of at most max_bytes UTF-8 bytes, at line ends where possible."""
    chunk: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        n = len(line.encode("utf-8"))
        if size + n > max_bytes and chunk:
            yield "".join(chunk)
            chunk, size = [], 0
        if n > max_bytes:  # one overlong line: cut it by characters (4 bytes each at worst)
            step = max_bytes // 4
            for i in range(0, len(line), step):
                yield line[i:i + step]
            continue
        chunk.append(line)
        size += n
    if chunk:
        yield "".join(chunk)


class _Sample:
    """The training sentences: a prefix of the input, not a random sample, so it is
    deterministic and streams; counts what it fed for the summary."""

    def __init__(self, docs: Iterator[Document], json_keys: list[str], max_bytes: int) -> None:
        self.docs, self.json_keys, self.max_bytes = docs, json_keys, max_bytes
        self.bytes = self.documents = 0
        self.error: BadRecordError | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            for doc in self.docs:
                self.documents += 1
                for key in self.json_keys:
                    for chunk in chunk_text(doc.fields[key]):
                        self.bytes += len(chunk.encode("utf-8"))
                        yield chunk
                        if self.bytes >= self.max_bytes:
                            return
        except BadRecordError as e:
            # sentencepiece aborts on it but re-raises it as a RuntimeError with a traceback in
            # the message; keep the original so callers see our clean file:line message.
            self.error = e
            raise


def train_tokenizer(
    inputs: list[str],
    vocab_size: int,
    model_type: str,
    output_prefix: str,
    json_keys: list[str] = ("text",),
    sample_bytes: int = DEFAULT_SAMPLE_BYTES,
    skip_bad_records: bool = False,
    num_threads: int = 2,
) -> TrainResult:
    """Train on up to sample_bytes of the inputs and write output_prefix.model/.vocab atomically."""
    start = time.perf_counter()
    json_keys = list(json_keys)
    skipped = SkippedRecords()
    sample = _Sample(iter_documents(inputs, json_keys, skip_bad_records, skipped), json_keys, sample_bytes)
    model = io.BytesIO()
    try:
        _train(sample, model, vocab_size, model_type, num_threads)
    except RuntimeError:
        if sample.error is not None:
            raise sample.error from None
        raise
    model_path, vocab_path = f"{output_prefix}.model", f"{output_prefix}.vocab"
    _write_atomically(model_path, vocab_path, model.getvalue())
    return TrainResult(model_path, vocab_path, vocab_size, sample.documents, sample.bytes, skipped,
                       time.perf_counter() - start)


def _train(sample: _Sample, model: io.BytesIO, vocab_size: int, model_type: str, num_threads: int) -> None:
    spm.set_random_generator_seed(SEED)  # pins any sampling the trainer does
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample),
        # A model_writer instead of a model_prefix keeps the output path out of the serialized
        # trainer spec, so identical inputs give identical .model bytes wherever they are written.
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        unk_id=0, unk_piece="<unk>",
        bos_id=1, bos_piece="<s>",
        eos_id=2, eos_piece="</s>",
        pad_id=-1,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=num_threads,
        minloglevel=1,
    )


def _write_atomically(model_path: str, vocab_path: str, model_bytes: bytes) -> None:
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    # Same "piece<TAB>score" layout sentencepiece writes for model_prefix training.
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    suffix = f".tmp-{os.getpid()}"
    try:
        with open(vocab_path + suffix, "w", encoding="utf-8") as f:
            f.write(vocab)
        with open(model_path + suffix, "wb") as f:
            f.write(model_bytes)
        os.replace(vocab_path + suffix, vocab_path)
        os.replace(model_path + suffix, model_path)
    except BaseException:
        for path in (vocab_path + suffix, model_path + suffix):
            if os.path.exists(path):
                os.remove(path)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, help="files or globs (.jsonl, .jsonl.gz, .txt, .parquet)")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", choices=["bpe", "unigram"], required=True)
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--sample-bytes", type=int, default=DEFAULT_SAMPLE_BYTES,
                        help="train on the first N bytes of text (sentencepiece holds them in memory)")
    parser.add_argument("--skip-bad-records", action="store_true")
    parser.add_argument("--num-threads", type=int, default=2,
                        help="trainer threads; recorded in the .model, so keep it fixed for identical output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = train_tokenizer(args.input, args.vocab_size, args.model_type, args.output_prefix,
                                 args.json_keys, args.sample_bytes, args.skip_bad_records, args.num_threads)
    except BadRecordError as e:
        sys.exit(f"error: {e}")
    except RuntimeError as e:  # sentencepiece reports bad settings (e.g. vocab too large) this way
        sys.exit(f"error: sentencepiece: {e}")
    logger.info(
        "wrote %s and %s: %s vocab %d, trained on %d documents / %d bytes, skipped bad records: %s, %.1fs",
        result.model_path, result.vocab_path, args.model_type, result.vocab_size, result.documents,
        result.sample_bytes, result.skipped.summary(), result.seconds,
    )


if __name__ == "__main__":
    main()
