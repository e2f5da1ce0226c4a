"""The tokenizers megatron-core's GPTDataset and our data prep use: sentencepiece and Hugging Face tokenizer.json.

Both follow Megatron-LM's semantics for its ``--tokenizer-type`` of the same name, so data written here is the data
Megatron-LM's tools/preprocess_data.py writes.
"""

import json
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Union, get_args

import sentencepiece as spm

from megatron_ext.config.schema import TokenizerType
from megatron_ext.errors import TokenizerError

TOKENIZER_TYPES: tuple[str, ...] = get_args(TokenizerType)
SENTENCEPIECE, HUGGING_FACE = TOKENIZER_TYPES


class _LoadedFromPath:
    """Pickles as its path, so shipping it to worker processes costs a reload, not a copy; and names itself by
    it in `unique_identifiers`, which megatron-core's MegatronDataset json-dumps to hash its index cache."""

    model_path: str

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("tokenizer_path", self.model_path)])


class SentencePieceTokenizer(_LoadedFromPath):
    """Megatron-LM GPTSentencePieceTokenizer semantics: no BOS on tokenize, eod is the EOS id."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._sp = spm.SentencePieceProcessor(model_file=model_path)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        # sentencepiece reports a disabled pad as -1, which is also megatron-core's _PAD_TOKEN_ID:
        # GPTDataset pads short samples with it and masks it out of the loss, and -1 can never
        # collide with a real token id in the data.
        return self._sp.pad_id()

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode_as_ids(text)

    def tokenize_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        # Default of one thread: data prep parallelises across processes, not within them.
        return self._sp.encode(texts, out_type=int, num_threads=num_threads)

    def detokenize(self, ids: list[int]) -> str:
        # int() so numpy arrays read back from an IndexedDataset decode too.
        return self._sp.decode_ids([int(i) for i in ids])


def _token_text(value: object) -> Optional[str]:
    """A special token as tokenizer_config.json / special_tokens_map.json spell it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class HuggingFaceTokenizer(_LoadedFromPath):
    """megatron-core's HuggingFaceTokenizer semantics (what Megatron-LM's tools/preprocess_data.py uses) for a
    directory AutoTokenizer loads (tokenizer.json, tokenizer_config.json): tokenize adds no special tokens unless
    `include_special_tokens` (then what the tokenizer's post-processor adds, Llama 3: the begin-of-text token, as
    its default since Megatron-LM 0.17 and its legacy tokenizer do); eod is the EOS id, vocab_size counts
    added tokens. Encodes with the `tokenizers` library itself (Rust, batched): the ids AutoTokenizer gives, without
    transformers' per-call overhead. Pickles as its directory and that flag.
    """

    def __init__(self, directory: str, include_special_tokens: bool = False) -> None:
        from tokenizers import Tokenizer

        self.model_path, self.include_special_tokens = directory, include_special_tokens
        path = Path(directory)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{directory}: no tokenizer.json — a Hugging Face tokenizer is a directory with "
                                 "tokenizer.json and tokenizer_config.json (as save_pretrained writes it)")
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._special = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in transformers
            if (path / name).is_file():
                config = json.loads((path / name).read_text())
                self._special.update({k: _token_text(config[k]) for k in ("bos_token", "eos_token", "pad_token")
                                      if _token_text(config.get(k)) is not None})
        eos = self._special.get("eos_token")
        self._eos = self._tok.token_to_id(eos) if eos else None
        if self._eos is None:
            raise TokenizerError(f"{directory}: the tokenizer has no end-of-text token (eos_token in "
                                 "tokenizer_config.json, present in the vocabulary): it marks document ends (EOD)")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eos

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def bos(self) -> Optional[int]:
        bos = self._special.get("bos_token")
        return self._tok.token_to_id(bos) if bos else None

    @property
    def pad(self) -> int:
        return -1  # as for sentencepiece: megatron-core's _PAD_TOKEN_ID, masked out of the loss

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path, "include_special_tokens": self.include_special_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"], state["include_special_tokens"])

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.include_special_tokens).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # the _fast variant leaves out the character offsets nothing here reads: the same ids, 1.3x the speed
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=self.include_special_tokens)]

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


Tokenizer = Union[SentencePieceTokenizer, HuggingFaceTokenizer]


def tokenizer_type(path: str, declared: Optional[str] = None) -> str:
    """`declared` (Megatron-LM's --tokenizer-type name), or what `path` is: a directory is a Hugging Face
    tokenizer, a file a sentencepiece model."""
    if declared is not None:
        if declared not in TOKENIZER_TYPES:
            raise TokenizerError(f"tokenizer type {declared!r}: one of {', '.join(TOKENIZER_TYPES)}")
        return declared
    if not Path(path).exists():
        raise TokenizerError(f"{path}: no such tokenizer (a sentencepiece .model file or a Hugging Face "
                             "tokenizer directory)")
    return HUGGING_FACE if Path(path).is_dir() else SENTENCEPIECE


def load_tokenizer(path: str, declared: Optional[str] = None, include_special_tokens: bool = False) -> Tokenizer:
    """The tokenizer at `path` (see tokenizer_type); `include_special_tokens`: see HuggingFaceTokenizer (a
    sentencepiece tokenizer adds none either way, as Megatron-LM's)."""
    if tokenizer_type(path, declared) == HUGGING_FACE:
        return HuggingFaceTokenizer(path, include_special_tokens)
    if not Path(path).is_file():
        raise TokenizerError(f"{path}: not a sentencepiece .model file")
    return SentencePieceTokenizer(path)


class VocabOnlyTokenizer:
    """Stands in for a tokenizer when the data is random tokens (data.mock): ids only, no text."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = -1

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", type(self).__qualname__), ("vocab_size", self.vocab_size)])
