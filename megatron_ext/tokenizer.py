"""SentencePiece tokenizer with the interface megatron-core's GPTDataset and our data prep expect."""

from collections import OrderedDict

import sentencepiece as spm


class SentencePieceTokenizer:
    """Megatron-LM GPTSentencePieceTokenizer semantics: no BOS on tokenize, eod is the EOS id.

    Pickles as its model path, so shipping it to worker processes costs a reload, not a copy.
    """

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._sp = spm.SentencePieceProcessor(model_file=model_path)

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

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

    @property
    def unique_identifiers(self) -> OrderedDict:
        # MegatronDataset json-dumps config.tokenizer through this to hash its index cache.
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("tokenizer_path", self.model_path)])

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode_as_ids(text)

    def tokenize_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        # Default of one thread: data prep parallelises across processes, not within them.
        return self._sp.encode(texts, out_type=int, num_threads=num_threads)

    def detokenize(self, ids: list[int]) -> str:
        # int() so numpy arrays read back from an IndexedDataset decode too.
        return self._sp.decode_ids([int(i) for i in ids])


class VocabOnlyTokenizer:
    """Stands in for a tokenizer when the data is random tokens (data.mock): ids only, no text."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = -1

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", type(self).__qualname__), ("vocab_size", self.vocab_size)])
