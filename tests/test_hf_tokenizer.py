"""Hugging Face byte-level BPE tokenizers end to end: trained here, loaded by transformers, written into datasets
byte-identical to Megatron-LM's tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer, trained on by the
recipe, exported with the model; and each bad input is one clear error."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from data_prep import train_tokenizer as train_mod
from megatron_ext.config.schema import load_config
from megatron_ext.data.checks import validate_data
from megatron_ext.data.tokenizer import HuggingFaceTokenizer, load_tokenizer
from megatron_ext.errors import ConfigError, TokenizerError
from tests.launch import ROOT, SINGLE_PROCESS, SMALL_MODEL, read_scalars, run_pretrain
from tests.megatron_reference import write_reference

with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
    warnings.simplefilter("ignore")
    from data_prep import inspect as inspect_mod
    from data_prep import preprocess as preprocess_mod

TEXTS = [f"def f{i}(x):\n    return x * {i}  # Café naïve, ünïcode ✓\n" * (1 + i % 4) for i in range(60)]
TEXTS[7] = ""  # an empty document: the post-processor's BOS alone, then EOD (as Megatron-LM writes it)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf_corpus") / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_tok") / "byte_bpe"
    train_mod.main(["--input", str(corpus), "--vocab-size", "400", "--model-type", "byte-bpe",
                    "--output-prefix", str(out)])
    return out


def test_byte_bpe_trains_deterministically_into_a_directory_transformers_loads(corpus, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    again = tmp_path / "again"
    train_mod.main(["--input", str(corpus), "--vocab-size", "400", "--model-type", "byte-bpe",
                    "--output-prefix", str(again)])
    assert (again / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    auto = AutoTokenizer.from_pretrained(tokenizer_dir)
    ours = HuggingFaceTokenizer(str(tokenizer_dir))
    assert (auto.bos_token, auto.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>") and auto.pad_token
    assert ours.eod == auto.eos_token_id and ours.bos == auto.bos_token_id and ours.vocab_size == len(auto) <= 400
    for text in [*TEXTS[:5], "", "日本語 and tabs\t\tand\r\nnewlines"]:
        assert ours.tokenize(text) == auto(text).input_ids, text
        assert ours.tokenize(text)[0] == auto.bos_token_id  # Llama 3: begin-of-text on every sequence
    assert ours.tokenize_batch(TEXTS[:5]) == [auto(t).input_ids for t in TEXTS[:5]]
    assert ours.detokenize(ours.tokenize("x = 1 ✓")) == "<|begin_of_text|>x = 1 ✓"


def test_preprocess_writes_megatron_lm_identical_datasets(corpus, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        preprocess_mod.main(["--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-type",
                             "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir), "--json-keys", "text",
                             "--append-eod", "--workers", str(workers), "--chunk-docs", "7"])
        outputs[workers] = [Path(f"{prefix}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")]
    assert outputs[1] == outputs[2]
    # Megatron-LM's _HuggingFaceTokenizer is AutoTokenizer with the defaults: tokenize = tokenizer(text).input_ids,
    # eod = eos_token_id, vocab_size = len(tokenizer)
    auto = AutoTokenizer.from_pretrained(tokenizer_dir)
    write_reference(TEXTS, lambda text: auto(text).input_ids, auto.eos_token_id, len(auto), tmp_path / "ref")
    assert outputs[1] == [(tmp_path / f"ref.{ext}").read_bytes() for ext in ("bin", "idx")]
    # the type is also detected from the path (a directory)
    preprocess_mod.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "auto"), "--tokenizer-model",
                         str(tokenizer_dir), "--append-eod"])
    assert Path(f"{tmp_path / 'auto'}_text_document.bin").read_bytes() == outputs[1][0]

    report = inspect_mod.report(f"{tmp_path / 'w1'}_text_document", samples=2, tokenizer_model=str(tokenizer_dir))
    vocab = HuggingFaceTokenizer(str(tokenizer_dir)).vocab_size
    assert f"vs vocabulary {vocab}" in report and ": ok" in report and "<|begin_of_text|>def f0(x):" in report
    assert "documents ending with EOD (id 1): 100.0%" in report


def test_bad_tokenizers_are_one_clear_error(tokenizer_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(str(empty))
    no_eos = tmp_path / "no_eos"
    shutil.copytree(tokenizer_dir, no_eos)
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


def test_recipe_refuses_a_smaller_vocabulary_and_data_from_another_tokenizer(corpus, tokenizer_dir, tmp_path):
    preprocess_mod.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "hf"), "--tokenizer-model",
                         str(tokenizer_dir), "--append-eod"])
    hf_data = f"{tmp_path / 'hf'}_text_document"
    base = [f"data.blend=[{hf_data}]", f"data.tokenizer_model={tokenizer_dir}"]
    vocab = HuggingFaceTokenizer(str(tokenizer_dir)).vocab_size
    validate_data(load_config(ROOT / "configs" / "tiny.yaml", base))
    with pytest.raises(ConfigError, match=rf"model.vocab_size=300 is invalid: must be >= the vocabulary of .* \({vocab}\)"):
        validate_data(load_config(ROOT / "configs" / "tiny.yaml", [*base, "model.vocab_size=300"]))
    # the default data was written with the 4096-piece sentencepiece tokenizer: ids beyond this one's vocabulary
    tiny = load_config(ROOT / "configs" / "tiny.yaml", [f"data.tokenizer_model={tokenizer_dir}"])
    with pytest.raises(ConfigError, match=rf"stdlib_text_document.bin holds token id \d+, but the model's "
                                          rf"vocabulary is {vocab} .* written with another tokenizer"):
        validate_data(tiny)


def _logits_and_export(checkpoint: Path, export: Path, tokens: torch.Tensor) -> torch.Tensor:
    from recipes import convert
    from tests.convert_logits_worker import checkpoint_logits

    convert.export_hf(checkpoint, export)
    return checkpoint_logits(checkpoint, tokens)


@pytest.mark.slow
def test_the_recipe_trains_on_it_and_exports_a_model_transformers_runs(corpus, tokenizer_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    preprocess_mod.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "hf"), "--tokenizer-model",
                         str(tokenizer_dir), "--append-eod"])
    ckpt = tmp_path / "ckpt"
    run_pretrain(1, [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=6", "optimizer.lr_decay_iters=null",
                     f"data.blend=[{tmp_path / 'hf'}_text_document]", f"data.tokenizer_model={tokenizer_dir}",
                     f"logging.tensorboard_dir={tmp_path / 'tb'}", f"checkpoint.save={ckpt}"])
    losses = read_scalars(tmp_path / "tb", "train/lm_loss")
    assert losses[6] < losses[1] - 0.5, losses

    auto = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = torch.tensor([auto("def f3(x):\n    return x * 3").input_ids])
    export = tmp_path / "export"
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        ours = pool.submit(_logits_and_export, ckpt, export, tokens).result()  # CPU rehearsal stays out of pytest
    exported_tok = AutoTokenizer.from_pretrained(export)
    assert exported_tok("x ✓").input_ids == auto("x ✓").input_ids and exported_tok.eos_token_id == auto.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager").eval()
    assert (model.config.bos_token_id, model.config.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    with torch.no_grad():
        theirs = model(tokens).logits
    assert (theirs - ours).abs().max().item() <= 1e-4 * ours.abs().max().item()
    generated = model.generate(tokens, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == tokens.shape[1] + 5 and isinstance(exported_tok.decode(generated[0]), str)


def _import(hf_dir: Path, output: Path) -> dict:
    from megatron.core import dist_checkpointing

    from recipes import convert

    convert.import_hf(hf_dir, output)
    return dist_checkpointing.load_common_state_dict(str(output / "iter_0000000"))["config"]["data"]


def test_import_hf_reads_and_records_a_tokenizer_json(tokenizer_dir, tmp_path):
    from tests.test_convert import make_hf_model

    hf = make_hf_model(tmp_path / "hf", vocab=512, kv_heads=2, tied=False, extra={}, save={})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, hf / name)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        data = pool.submit(_import, hf, tmp_path / "ckpt").result()
    assert data["tokenizer_model"] == str(tmp_path / "ckpt" / "tokenizer")
    assert data["tokenizer_type"] == "HuggingFaceTokenizer"
    assert load_tokenizer(data["tokenizer_model"]).tokenize("x") == HuggingFaceTokenizer(str(tokenizer_dir)).tokenize("x")
