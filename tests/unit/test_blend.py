"""Blends: weighted data.blend proportions, per-split blends, and bad blends rejected as ConfigError; the document
switches reach the samples built from prepared data."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data_prep.train_tokenizer import train_tokenizer
from megatron_ext.config.schema import load_config
from megatron_ext.data.checks import validate_data
from megatron_ext.data.tokenizer import SentencePieceTokenizer
from megatron_ext.errors import ConfigError
from tests.launch import TINY

with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
    warnings.simplefilter("ignore")
    from data_prep.preprocess import preprocess
    from megatron_ext.data.datasets import build_datasets

# Two corpora told apart by their characters: A is lowercase letters only, B uppercase and digits
# only, so every decoded sample shows which dataset it came from.
LOWER = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]
UPPER = ["ZULU", "YANKEE", "XRAY", "WHISKEY", "VICTOR", "TANGO", "SIERRA", "ROMEO", "QUEBEC", "PAPA"]
TRAIN_SAMPLES = 4000  # train_iters × global_batch_size below
# megatron-core's blending is deterministic and error-minimising: each dataset's count is its weight × the
# samples drawn, rounded either way (measured: within 1 sample of 4,000+).
SAMPLE_TOLERANCE = 1


def _texts(words: list[str], digits: bool, n: int) -> list[str]:
    texts = []
    for i in range(n):
        line = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 11))
        texts.append(line + (f" {i * 37 % 1000}" if digits else "") + "\n")
    return texts


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("blend")
    corpora = {"a": _texts(LOWER, False, 300), "b": _texts(UPPER, True, 300)}
    for name, texts in corpora.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    inputs = [str(root / f"{name}.jsonl") for name in corpora]
    model = train_tokenizer(inputs, 400, "bpe", str(root / "tok")).model_path
    prefixes = {name: preprocess([str(root / f"{name}.jsonl")], str(root / name), model).prefixes[0]
                for name in corpora}
    return SimpleNamespace(a=prefixes["a"], b=prefixes["b"], model=model,
                           tokenizer=SentencePieceTokenizer(model))


def _config(data: SimpleNamespace, *overrides: str):
    # data.blend defaults to dataset A, so the test never depends on the default data being prepared.
    return load_config(TINY, [
        f"data.blend=[{data.a}]", f"data.tokenizer_model={data.model}", "model.seq_length=32",
        "train.global_batch_size=16",
        "train.micro_batch_size=4", f"train.train_iters={TRAIN_SAMPLES // 16}", "train.eval_iters=4",
        *overrides])


def _source(data: SimpleNamespace, sample: dict) -> str:
    """'a' or 'b' from the characters of a sample's decoded tokens; fails on a mix."""
    window = sample["tokens"].tolist() + sample["labels"].tolist()[-1:]
    ids = [int(i) for i in window if i >= 0 and i != data.tokenizer.eod]
    text = data.tokenizer.detokenize(ids)
    lower, upper = any(c.islower() for c in text), any(c.isupper() or c.isdigit() for c in text)
    assert lower != upper, f"sample mixes both corpora: {text!r}"
    return "a" if lower else "b"


def test_weighted_blend_samples_in_proportion(data):
    cfg = _config(data, f"data.blend=[0.3,{data.a},0.7,{data.b}]")
    validate_data(cfg)
    train, valid, _ = build_datasets(cfg, data.tokenizer)

    assert len(train) >= TRAIN_SAMPLES
    counts, drawn = np.bincount(train.dataset_index, minlength=2), len(train.dataset_index)
    assert abs(counts[0] - 0.3 * drawn) <= SAMPLE_TOLERANCE and abs(counts[1] - 0.7 * drawn) <= SAMPLE_TOLERANCE, \
        (counts, drawn)
    # Over any prefix of the run too (the blend is interleaved, not 1,200 A's then 2,800 B's).
    first = np.bincount(train.dataset_index[:400], minlength=2) / 400
    assert abs(first[0] - 0.3) < 0.02, first
    # The samples really come from the dataset the index names (checked by their text).
    for i in range(0, len(train), 97):
        sample = train[i]
        assert sample["dataset_id"] == train.dataset_index[i]
        assert _source(data, sample) == "ab"[int(sample["dataset_id"])]

    assert valid is not None and len(valid) >= 4 * 16  # validation is blended the same way
    valid_shares = np.bincount(valid.dataset_index, minlength=2) / len(valid.dataset_index)
    assert abs(valid_shares[0] - 0.3) < 0.05, valid_shares


def test_unweighted_blend_is_proportional_to_dataset_sizes(data):
    train, _, _ = build_datasets(_config(data, f"data.blend=[{data.a},{data.b}]"), data.tokenizer)
    sizes = [len(d) for d in train.datasets]
    counts, drawn = np.bincount(train.dataset_index, minlength=2), len(train.dataset_index)
    assert abs(counts[0] - drawn * sizes[0] / sum(sizes)) <= SAMPLE_TOLERANCE, (counts, drawn, sizes)


def test_per_split_blends(data):
    cfg = _config(data, f"data.train_blend=[{data.a}]", f"data.valid_blend=[{data.b}]", "data.blend=null")
    validate_data(cfg)
    train, valid, _ = build_datasets(cfg, data.tokenizer)
    # A single prefix per split is a GPTDataset over the whole file (no split fractions applied).
    assert train.dataset.path_prefix == data.a and valid.dataset.path_prefix == data.b
    assert len(train) >= TRAIN_SAMPLES and len(valid) >= 4 * 16
    assert {_source(data, train[i]) for i in range(0, len(train), 211)} == {"a"}
    assert {_source(data, valid[i]) for i in range(len(valid))} == {"b"}

    # Per-split blends take weights too.
    cfg = _config(data, f"data.train_blend=[1,{data.a},3,{data.b}]", f"data.valid_blend=[{data.b}]")
    train, _, _ = build_datasets(cfg, data.tokenizer)
    counts, drawn = np.bincount(train.dataset_index, minlength=2), len(train.dataset_index)
    assert abs(counts[0] - 0.25 * drawn) <= SAMPLE_TOLERANCE, (counts, drawn)


def test_the_test_split_is_built_from_test_blend_or_the_split_and_sized_for_one_evaluation(data):
    _, _, none = build_datasets(_config(data, f"data.blend=[{data.a}]", "data.split=98,2,0"), data.tokenizer)
    _, _, held_out = build_datasets(_config(data, f"data.blend=[{data.a}]", "data.split=90,5,5"), data.tokenizer)
    _, _, own = build_datasets(_config(data, f"data.train_blend=[{data.a}]", f"data.valid_blend=[{data.a}]",
                                       f"data.test_blend=[{data.b}]", "data.blend=null"), data.tokenizer)
    assert none is None and len(held_out) >= 4 * 16 and len(own) >= 4 * 16
    assert {_source(data, own[i]) for i in range(len(own))} == {"b"}


@pytest.mark.parametrize("blend, key, fragment", [
    ("[0.3,{a},0.7]", "data.blend", "use [prefix, ...] or [weight1, prefix1"),
    ("[{a},0.7]", "data.blend", "use [prefix, ...] or [weight1, prefix1"),
    ("[0.3,{a},{b},0.7]", "data.blend", "use [prefix, ...] or [weight1, prefix1"),
    ("[0,{a},1,{b}]", "data.blend", "every weight must be > 0"),
    ("[-1,{a},2,{b}]", "data.blend", "every weight must be > 0"),
    ("[1,{a},1,{a}_missing]", "data.blend", "_missing.bin does not exist"),
    ("[{a}.bin]", "data.blend", ".bin.bin does not exist"),  # a file name instead of a prefix
    ("[0.5,{a},0.5]", "data.train_blend", "data.train_blend="),
])
def test_bad_blend_is_a_config_error(data, blend, key, fragment):
    cfg = _config(data, f"{key}={blend.format(a=data.a, b=data.b)}")
    with pytest.raises(ConfigError) as err:
        validate_data(cfg)
    assert fragment in str(err.value) and str(err.value).startswith(key), str(err.value)


def test_no_blend_at_all_is_a_config_error(data):
    with pytest.raises(ConfigError, match=r"data.blend=None is invalid: give a dataset prefix list"):
        validate_data(_config(data, "data.blend=null"))


@pytest.mark.parametrize("documents", [True, False])
def test_the_data_switches_reach_the_samples_the_trainer_reads(data, documents):
    """data.reset_position_ids / reset_attention_mask / eod_mask_loss, through build_datasets and the data loader's
    collate: positions restart after each EOD, the EOD tokens leave the loss, each token carries its document's id;
    switched off, positions run on and every token counts."""
    from megatron_ext.data.datasets import microbatch_iterator

    on = str(documents).lower()
    cfg = _config(data, f"data.reset_position_ids={on}", f"data.reset_attention_mask={on}",
                  f"data.eod_mask_loss={on}")
    train, _, _ = build_datasets(cfg, data.tokenizer)
    batch = next(microbatch_iterator(train, 0, 4, 0, 1, 0, documents_eod=data.tokenizer.eod if documents else None))
    tokens, positions, loss_mask = batch["tokens"], batch["position_ids"], batch["loss_mask"]
    eod = tokens == data.tokenizer.eod
    assert eod.sum() >= 4  # short lines: every sequence holds several documents
    if not documents:
        assert "documents" not in batch and bool((loss_mask == 1).all())
        assert bool((positions == torch.arange(tokens.size(1))).all())
        return
    assert bool((loss_mask == (~eod).float()).all())
    after_eod = torch.zeros_like(eod)
    after_eod[:, 1:] = eod[:, :-1]
    assert bool((positions[after_eod] == 0).all())
    assert bool((positions[:, 1:][~after_eod[:, 1:]] == positions[:, :-1][~after_eod[:, 1:]] + 1).all())
    ids = batch["documents"]
    assert bool((ids[:, 1:] - ids[:, :-1] == after_eod[:, 1:].to(ids.dtype)).all())


def test_eod_mask_loss_leaves_the_eod_positions_out_of_the_loss_the_trainer_sums(data, monkeypatch):
    """data.eod_mask_loss through the run's own data (RunData) and the trainer's micro-batch step into the loss it
    sums: every token's loss counts but the EOD tokens' (one process: no context-parallel cut)."""
    from megatron_ext.training import micro_batch, run_data

    monkeypatch.setattr(micro_batch, "get_batch_on_this_cp_rank", lambda batch, **_: batch)
    monkeypatch.setattr(micro_batch.parallel_state, "get_context_parallel_group", lambda: None)
    monkeypatch.setattr(micro_batch, "device", lambda: torch.device("cpu"))
    monkeypatch.setattr(run_data.parallel_state, "get_data_parallel_rank", lambda: 0)
    for on in (True, False):
        cfg = _config(data, f"data.eod_mask_loss={str(on).lower()}")
        seen = {}

        def model(tokens, positions, **_):
            seen["tokens"] = tokens
            return torch.arange(1, tokens.numel() + 1, dtype=torch.float32).view(tokens.shape)  # one loss per token

        batches = run_data.RunData(cfg, data.tokenizer, 1, 1, speak=False).iterators(
            build_datasets(cfg, data.tokenizer)[0])
        output, loss = micro_batch.forward_step(batches, model)
        loss_sum, num_tokens, _ = loss(output)
        counted = seen["tokens"] != data.tokenizer.eod if on else torch.ones_like(seen["tokens"], dtype=torch.bool)
        assert 0 < int(num_tokens) == int(counted.sum()) and float(loss_sum) == float(output[counted].sum())
        assert on == (int(num_tokens) < seen["tokens"].numel())


def test_data_num_workers_reaches_the_runs_data_loader(data, monkeypatch):
    """data.num_workers through RunData's iterators: the loader runs that many worker processes."""
    from megatron_ext.training import run_data

    monkeypatch.setattr(run_data.parallel_state, "get_data_parallel_rank", lambda: 0)
    cfg = _config(data, "data.num_workers=2")
    run = run_data.RunData(cfg, data.tokenizer, 1, 1, speak=False)
    batches = run.iterators(run.train)
    next(batches)
    assert batches._num_workers == 2 and len(batches._workers) == 2
    del batches
