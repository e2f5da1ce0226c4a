"""Hugging Face byte-level BPE tokenizers: trained here, loaded by transformers, written into datasets
byte-identical to Megatron-LM's tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer; each bad input
is one clear error."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from data_prep import train_tokenizer as train_mod
from megatron_ext.config.schema import load_config
from megatron_ext.data.checks import validate_data
from megatron_ext.data.tokenizer import HuggingFaceTokenizer, load_tokenizer
from megatron_ext.errors import ConfigError, TokenizerError
from tests.corpora import UNICODE_TEXTS
from tests.launch import ROOT
from tests.megatron_reference import write_reference

with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
    warnings.simplefilter("ignore")
    from data_prep import inspect as inspect_mod
    from data_prep import preprocess as preprocess_mod


def test_byte_bpe_trains_deterministically_into_a_directory_transformers_loads(unicode_corpus, byte_bpe_dir, tmp_path):
    from transformers import AutoTokenizer

    again = tmp_path / "again"
    train_mod.main(["--input", str(unicode_corpus), "--vocab-size", "400", "--model-type", "byte-bpe",
                    "--output-prefix", str(again)])
    assert (again / "tokenizer.json").read_bytes() == (byte_bpe_dir / "tokenizer.json").read_bytes()
    auto = AutoTokenizer.from_pretrained(byte_bpe_dir)
    ours = HuggingFaceTokenizer(str(byte_bpe_dir))
    assert (auto.bos_token, auto.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>") and auto.pad_token
    assert ours.eod == auto.eos_token_id and ours.bos == auto.bos_token_id and ours.vocab_size == len(auto) <= 400
    for text in [*UNICODE_TEXTS[:5], "", "日本語 and tabs\t\tand\r\nnewlines"]:
        assert ours.tokenize(text) == auto(text).input_ids, text
        assert ours.tokenize(text)[0] == auto.bos_token_id  # Llama 3: begin-of-text on every sequence
    assert ours.tokenize_batch(UNICODE_TEXTS[:5]) == [auto(t).input_ids for t in UNICODE_TEXTS[:5]]
    assert ours.detokenize(ours.tokenize("x = 1 ✓")) == "<|begin_of_text|>x = 1 ✓"


def test_preprocess_writes_megatron_lm_identical_datasets(unicode_corpus, byte_bpe_dir, tmp_path):
    from transformers import AutoTokenizer

    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        preprocess_mod.main(["--input", str(unicode_corpus), "--output-prefix", str(prefix), "--tokenizer-type",
                             "HuggingFaceTokenizer", "--tokenizer-model", str(byte_bpe_dir), "--json-keys", "text",
                             "--append-eod", "--workers", str(workers), "--chunk-docs", "7"])
        outputs[workers] = [Path(f"{prefix}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")]
    assert outputs[1] == outputs[2]
    # Megatron-LM's _HuggingFaceTokenizer is AutoTokenizer with the defaults: tokenize = tokenizer(text).input_ids,
    # eod = eos_token_id, vocab_size = len(tokenizer)
    auto = AutoTokenizer.from_pretrained(byte_bpe_dir)
    write_reference(UNICODE_TEXTS, lambda text: auto(text).input_ids, auto.eos_token_id, len(auto), tmp_path / "ref")
    assert outputs[1] == [(tmp_path / f"ref.{ext}").read_bytes() for ext in ("bin", "idx")]
    # the type is also detected from the path (a directory)
    preprocess_mod.main(["--input", str(unicode_corpus), "--output-prefix", str(tmp_path / "auto"), "--tokenizer-model",
                         str(byte_bpe_dir), "--append-eod"])
    assert Path(f"{tmp_path / 'auto'}_text_document.bin").read_bytes() == outputs[1][0]

    report = inspect_mod.report(f"{tmp_path / 'w1'}_text_document", samples=2, tokenizer_model=str(byte_bpe_dir))
    vocab = HuggingFaceTokenizer(str(byte_bpe_dir)).vocab_size
    assert f"vs vocabulary {vocab}" in report and ": ok" in report and "<|begin_of_text|>def f0(x):" in report
    assert "documents ending with EOD (id 1): 100.0%" in report


def test_bad_tokenizers_are_one_clear_error(byte_bpe_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(str(empty))
    no_eos = tmp_path / "no_eos"
    shutil.copytree(byte_bpe_dir, no_eos)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((no_eos / name).read_text())
        del config["eos_token"]
        (no_eos / name).write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no end-of-text token"):
        load_tokenizer(str(no_eos))
    with pytest.raises(SystemExit) as exit_:
        preprocess_mod.main(["--input", "x.jsonl", "--output-prefix", str(tmp_path / "o"), "--tokenizer-model",
                             str(empty)])
    assert exit_.value.code == 2


def test_recipe_refuses_a_smaller_vocabulary_and_data_from_another_tokenizer(unicode_corpus, byte_bpe_dir, tmp_path):
    preprocess_mod.main(["--input", str(unicode_corpus), "--output-prefix", str(tmp_path / "hf"), "--tokenizer-model",
                         str(byte_bpe_dir), "--append-eod"])
    hf_data = f"{tmp_path / 'hf'}_text_document"
    base = [f"data.blend=[{hf_data}]", f"data.tokenizer_model={byte_bpe_dir}"]
    vocab = HuggingFaceTokenizer(str(byte_bpe_dir)).vocab_size
    validate_data(load_config(ROOT / "configs" / "tiny.yaml", base))
    with pytest.raises(ConfigError, match=rf"model.vocab_size=300 is invalid: must be >= the vocabulary of .* \({vocab}\)"):
        validate_data(load_config(ROOT / "configs" / "tiny.yaml", [*base, "model.vocab_size=300"]))
    # the default data was written with the 4096-piece sentencepiece tokenizer: ids beyond this one's vocabulary
    tiny = load_config(ROOT / "configs" / "tiny.yaml", [f"data.tokenizer_model={byte_bpe_dir}"])
    with pytest.raises(ConfigError, match=rf"stdlib_text_document.bin holds token id \d+, but the model's "
                                          rf"vocabulary is {vocab} .* written with another tokenizer"):
        validate_data(tiny)


