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
from megatron_ext.data.tokenization_record import describe_blend, mixed_conventions, read_record, record_path
from megatron_ext.data.tokenizer import HuggingFaceTokenizer, load_tokenizer
from megatron_ext.errors import ConfigError, TokenizerError
from tests.corpora import UNICODE_TEXTS
from tests.launch import ROOT
from tests.megatron_reference import megatron_hf_tokenizer, write_reference

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
    ours, with_special = HuggingFaceTokenizer(str(byte_bpe_dir)), HuggingFaceTokenizer(str(byte_bpe_dir), True)
    assert (auto.bos_token, auto.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>") and auto.pad_token
    assert ours.eod == auto.eos_token_id and ours.bos == auto.bos_token_id and ours.vocab_size == len(auto) <= 400
    megatron, megatron_special = megatron_hf_tokenizer(byte_bpe_dir, False), megatron_hf_tokenizer(byte_bpe_dir, True)
    assert megatron.eod == ours.eod
    for text in [*UNICODE_TEXTS[:5], "", " \t\n ", "日本語 and tabs\t\tand\r\nnewlines"]:
        # --tokenizer-hf-no-include-special-tokens; Megatron-LM's default (with them) is AutoTokenizer's
        assert ours.tokenize(text) == megatron.tokenize(text), text
        assert with_special.tokenize(text) == megatron_special.tokenize(text) == auto(text).input_ids, text
        assert with_special.tokenize(text)[0] == auto.bos_token_id  # Llama 3: begin-of-text on every sequence
    assert ours.tokenize_batch(UNICODE_TEXTS[:5]) == [megatron.tokenize(t) for t in UNICODE_TEXTS[:5]]
    assert with_special.tokenize_batch(UNICODE_TEXTS[:5]) == [auto(t).input_ids for t in UNICODE_TEXTS[:5]]
    assert with_special.detokenize(with_special.tokenize("x = 1 ✓")) == "<|begin_of_text|>x = 1 ✓"


@pytest.mark.parametrize("flag, convention", [(None, "include-special-tokens"),
                                              ("--tokenizer-hf-no-include-special-tokens", "no-include-special-tokens"),
                                              ("--legacy-tokenizer", "legacy")])
def test_preprocess_writes_megatron_lm_identical_datasets(flag, convention, unicode_corpus, byte_bpe_dir, tmp_path):
    """Megatron-LM core_v0.19's tools/preprocess_data.py with the same flag: its default path (megatron-core's
    tokenizer with special tokens: BOS on every document), --tokenizer-hf-no-include-special-tokens (no BOS, nothing
    for an empty document), and --legacy-tokenizer (AutoTokenizer: tokenize = tokenizer(text).input_ids). The corpus
    has an empty and a whitespace-only document."""
    from transformers import AutoTokenizer

    outputs = {}
    for workers in (1, 2) if flag is None else (2,):
        prefix = tmp_path / f"w{workers}"
        preprocess_mod.main(["--input", str(unicode_corpus), "--output-prefix", str(prefix), "--tokenizer-type",
                             "HuggingFaceTokenizer", "--tokenizer-model", str(byte_bpe_dir), "--json-keys", "text",
                             "--append-eod", "--workers", str(workers), "--chunk-docs", "7", *([flag] if flag else [])])
        outputs[workers] = [Path(f"{prefix}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")]
    assert len({tuple(output) for output in outputs.values()}) == 1
    auto = AutoTokenizer.from_pretrained(byte_bpe_dir)
    tokenize = (lambda text: auto(text).input_ids) if convention == "legacy" else \
        megatron_hf_tokenizer(byte_bpe_dir, convention != "no-include-special-tokens").tokenize
    write_reference(UNICODE_TEXTS, tokenize, auto.eos_token_id, len(auto), tmp_path / "ref")
    assert outputs[2] == [(tmp_path / f"ref.{ext}").read_bytes() for ext in ("bin", "idx")]

    prefix = f"{tmp_path / 'w2'}_text_document"
    record = read_record(prefix)
    assert (record.convention, record.begins_with_bos, record.append_eod) == (
        convention, convention != "no-include-special-tokens", True)
    report = inspect_mod.report(prefix, samples=2, tokenizer_model=str(byte_bpe_dir))
    vocab = HuggingFaceTokenizer(str(byte_bpe_dir)).vocab_size
    assert f"vs vocabulary {vocab}" in report and ": ok" in report
    assert f"tokenized {record.describe()}, with {byte_bpe_dir}" in report
    assert f"\n{'<|begin_of_text|>' if record.begins_with_bos else ''}def f0(x):" in report  # the first sample, decoded
    assert "documents ending with EOD (id 1): 100.0%" in report
    if flag is None:  # the type is also detected from the path (a directory)
        preprocess_mod.main(["--input", str(unicode_corpus), "--output-prefix", str(tmp_path / "auto"),
                             "--tokenizer-model", str(byte_bpe_dir), "--append-eod"])
        assert Path(f"{tmp_path / 'auto'}_text_document.bin").read_bytes() == outputs[1][0]


def test_a_blend_that_mixes_bos_conventions_is_said_once_naming_the_datasets(unicode_corpus, byte_bpe_dir,
                                                                            tmp_path):
    prefixes = []
    for name, flags in (("no_special", ["--tokenizer-hf-no-include-special-tokens"]), ("legacy", ["--legacy-tokenizer"])):
        preprocess_mod.main(["--input", str(unicode_corpus), "--output-prefix", str(tmp_path / name),
                             "--tokenizer-model", str(byte_bpe_dir), "--append-eod", *flags])
        prefixes.append(f"{tmp_path / name}_text_document")
    assert mixed_conventions(prefixes[:1]) is None and mixed_conventions(prefixes[1:]) is None
    said = mixed_conventions(prefixes)
    assert said.startswith(f"the blend mixes tokenization conventions: documents begin with BOS in {prefixes[1]} "
                           f"but not in {prefixes[0]}"), said
    assert describe_blend(prefixes).count("HuggingFaceTokenizer") == 2


def test_a_record_written_before_the_default_changed_reads_as_no_special_tokens(tmp_path):
    """data_prep before Megatron-LM 0.17's default recorded its no-special-tokens default as "default"."""
    record_path(str(tmp_path / "old")).write_text(json.dumps(
        {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer": "tok", "convention": "default", "append_eod": True,
         "begins_with_bos": False}))
    record = read_record(str(tmp_path / "old"))
    assert record.convention == "no-include-special-tokens"
    assert "--tokenizer-hf-no-include-special-tokens" in record.describe()


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




def test_a_failed_byte_bpe_training_keeps_the_previous_tokenizer(unicode_corpus, byte_bpe_dir, tmp_path, monkeypatch):
    """The new directory cannot be moved into place (a full or read-only disk at the last step): the previous
    tokenizer is back under its name, whole, and nothing else is left beside it."""
    previous = tmp_path / "tok"
    shutil.copytree(byte_bpe_dir, previous)
    before = sorted(p.name for p in previous.iterdir())
    real_replace = train_mod.os.replace

    def failing_replace(src, dst):
        if str(src).startswith(f"{previous}.tmp-"):
            raise OSError(28, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(train_mod.os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        train_mod.main(["--input", str(unicode_corpus), "--vocab-size", "400", "--model-type", "byte-bpe",
                              "--output-prefix", str(previous)])
    assert sorted(p.name for p in previous.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
