"""Trains a deterministic Llama-style tokenizer: sentencepiece (bpe/unigram, byte fallback, code-preserving)
into PREFIX.model/.vocab, or a Llama-3-style byte-level BPE (`tokenizers`) into the directory PREFIX/, which
transformers.AutoTokenizer loads as is."""

import argparse
import io
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import sentencepiece as spm

from data_prep.records import Document, SkippedRecords, iter_documents
from megatron_ext.errors import BadRecordError

logger = logging.getLogger(__name__)

# sentencepiece silently drops training sentences longer than this many bytes, so we chunk below it.
MAX_SENTENCE_BYTES = 8192
DEFAULT_SAMPLE_BYTES = 100_000_000
SEED = 1234
MODEL_TYPES = ("bpe", "unigram", "byte-bpe")
# byte-bpe: Llama 3's special tokens (begin of text is added to every sequence, end of text is the EOD) and its
# pre-tokenizer split (contractions, letters, up to 3 digits, punctuation runs, whitespace) before byte mapping.
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


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
    if model_type == "byte-bpe":
        try:
            directory = _train_byte_bpe(sample, vocab_size, output_prefix)
        except BaseException:
            if sample.error is not None:
                raise sample.error from None
            raise
        return TrainResult(directory, os.path.join(directory, "tokenizer.json"), vocab_size, sample.documents,
                           sample.bytes, skipped, time.perf_counter() - start)
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


def _train_byte_bpe(sample: _Sample, vocab_size: int, directory: str) -> str:
    """Byte-level BPE with the `tokenizers` library, saved by transformers' save_pretrained into `directory`
    (replaced atomically): tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(iter(sample), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                      clean_up_tokenization_spaces=False)
    directory = os.path.abspath(directory)
    tmp, old = f"{directory}.tmp-{os.getpid()}", f"{directory}.old-{os.getpid()}"
    moved_aside = False
    try:
        wrapped.save_pretrained(tmp)
        # transformers 5 names its own backend class; the 4.x releases in NGC containers know the fast class by
        # its old name, which 5.x still loads
        config_path = os.path.join(tmp, "tokenizer_config.json")
        with open(config_path) as f:
            config = json.load(f)
        config.pop("backend", None)
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, "special_tokens_map.json"), "w") as f:  # what transformers 4.x also reads
            json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, f, indent=2)
        if os.path.exists(directory):
            os.replace(directory, old)
            moved_aside = True
        os.replace(tmp, directory)
    except BaseException:
        if moved_aside:  # the previous tokenizer goes back where it was: a failed run loses nothing
            os.replace(old, directory)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return directory


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
    parser.add_argument("--model-type", choices=MODEL_TYPES, required=True,
                        help="bpe/unigram: sentencepiece; byte-bpe: Llama-3-style byte-level BPE (tokenizers)")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX.model and PREFIX.vocab (sentencepiece), or the directory PREFIX/ (byte-bpe)")
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
        "wrote %s: %s vocab %d, trained on %d documents / %d bytes, skipped bad records: %s, %.1fs",
        result.model_path if args.model_type == "byte-bpe" else f"{result.model_path} and {result.vocab_path}",
        args.model_type, result.vocab_size, result.documents, result.sample_bytes, result.skipped.summary(),
        result.seconds,
    )
    logger.info("tokenizer for data_prep.preprocess --tokenizer-model and data.tokenizer_model: %s", result.model_path)


if __name__ == "__main__":
    main()
