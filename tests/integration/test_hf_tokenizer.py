"""Hugging Face tokenizers through the recipe: trained on, exported with the model transformers runs, and
recorded by import-hf."""

from __future__ import annotations

import multiprocessing
import shutil
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from megatron_ext.data.tokenizer import HuggingFaceTokenizer, load_tokenizer
from tests.launch import SINGLE_PROCESS, SMALL_MODEL, read_scalars, run_pretrain

with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
    warnings.simplefilter("ignore")
    from data_prep import preprocess as preprocess_mod


def _logits_and_export(checkpoint: Path, export: Path, tokens: torch.Tensor) -> torch.Tensor:
    from recipes import convert
    from tests.workers.convert_logits_worker import checkpoint_logits

    convert.export_hf(checkpoint, export)
    return checkpoint_logits(checkpoint, tokens)


def test_the_recipe_trains_on_it_and_exports_a_model_transformers_runs(unicode_corpus, byte_bpe_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    preprocess_mod.main(["--input", str(unicode_corpus), "--output-prefix", str(tmp_path / "hf"), "--tokenizer-model",
                         str(byte_bpe_dir), "--append-eod"])
    ckpt = tmp_path / "ckpt"
    trained = run_pretrain(1, [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=6", "optimizer.lr_decay_iters=null",
                               f"data.blend=[{tmp_path / 'hf'}_text_document]", f"data.tokenizer_model={byte_bpe_dir}",
                               f"logging.tensorboard_dir={tmp_path / 'tb'}", f"checkpoint.save={ckpt}"])
    assert ("data: tokenized HuggingFaceTokenizer (Megatron-LM's default, with special tokens), EOD appended; "
            "documents begin with BOS") in trained.stdout + trained.stderr
    losses = read_scalars(tmp_path / "tb", "train/lm_loss")
    assert min(losses[step] for step in (4, 5, 6)) < losses[1] - 0.5, losses  # 6 steps at lr 3e-3 are noisy

    auto = AutoTokenizer.from_pretrained(byte_bpe_dir)
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
    from megatron_ext.checkpoint.common_state import read_common
    from recipes import convert

    convert.import_hf(hf_dir, output)
    return read_common(output / "iter_0000000").config["data"]


def test_import_hf_reads_and_records_a_tokenizer_json(byte_bpe_dir, tmp_path):
    from tests.integration.test_convert import make_hf_model

    hf = make_hf_model(tmp_path / "hf", vocab=512, kv_heads=2, tied=False, extra={}, save={})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(byte_bpe_dir / name, hf / name)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        data = pool.submit(_import, hf, tmp_path / "ckpt").result()
    assert data["tokenizer_model"] == str(tmp_path / "ckpt" / "tokenizer")
    assert data["tokenizer_type"] == "HuggingFaceTokenizer"
    assert load_tokenizer(data["tokenizer_model"]).tokenize("x") == HuggingFaceTokenizer(str(byte_bpe_dir)).tokenize("x")
