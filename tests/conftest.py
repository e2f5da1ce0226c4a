"""Shared fixtures: one set of initial weights and a single-process reference run for every layout test; the
corpora and tokenizers of the data tests; and the guard that no test writes into the repository tree (runs
belong in pytest's tmp_path)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from data_prep import train_tokenizer as train_mod
from tests.corpora import UNICODE_TEXTS, code_docs, write_jsonl
from tests.launch import ROOT, SESSION_TEMP_DIRS, SINGLE_PROCESS, SMALL_MODEL, run_pretrain

_NOT_THE_TREE = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".te1", ".te2", ".te3", ".whl"}
_TREE = pytest.StashKey[dict[str, int]]()


def _tree() -> dict[str, int]:
    files = {}
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _NOT_THE_TREE]
        for name in names:
            path = os.path.join(top, name)
            relative = os.path.relpath(path, ROOT)
            # the caches next to a dataset unless data.path_to_cache says otherwise (megatron-core's GPTDataset
            # indices, the largest token id), as `make pretrain` writes them too: derived files, not the tree
            if relative.startswith("data" + os.sep) and f"{os.sep}cache{os.sep}" in relative:
                continue
            files[relative] = os.stat(path, follow_symlinks=False).st_mtime_ns
    return files


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_TREE] = _tree()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for directory in SESSION_TEMP_DIRS:
        shutil.rmtree(directory, ignore_errors=True)
    before, after = session.config.stash.get(_TREE, None), _tree()
    if before is None:
        return
    written = sorted(path for path, mtime in after.items() if before.get(path) != mtime)
    if written:
        print(f"\nFAILED: the tests wrote into the repository tree {ROOT} ({len(written)} files): "
              + ", ".join(written[:10]) + (" ..." if len(written) > 10 else ""))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# With REQUIRE_ALL=1 (.ci/run) a test skipped for anything but a missing GPU (or TransformerEngine, which needs one)
# fails: CI cannot skip what the suite claims to prove on a CPU machine
GPU_ONLY_SKIPS = ("GPU", "TransformerEngine")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("REQUIRE_ALL") == "1":
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        if not any(word in reason for word in GPU_ONLY_SKIPS):
            report.outcome = "failed"
            report.longrepr = f"REQUIRE_ALL=1 but {item.nodeid} was skipped: {reason}"


# No warm-up: step 1 already trains at the full rate, so the losses compared at steps 2..6 reach through up to 5
# optimizer updates (with a warm-up from 0, step 1 would not move the weights).
PARITY_STEPS = 6
SCHEDULE_ITERS = 20  # every parity run uses the LR schedule of a 20-step run


@pytest.fixture(scope="session")
def initial_weights(tmp_path_factory) -> Path:
    """Weights saved by a 1-process run at iteration 0: CPU init differs across PP sizes, so every
    layout loads these instead of initialising its own."""
    path = tmp_path_factory.mktemp("init") / "ckpt"
    run_pretrain(1, [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=0", f"checkpoint.save={path}",
                     "logging.tensorboard_dir=null"])
    return path


def parity_overrides(initial_weights: Path | None, tensorboard_dir: Path, steps: int = PARITY_STEPS) -> list[str]:
    """The small model on a 20-step LR schedule without warm-up, logging to `tensorboard_dir`, from
    `initial_weights`."""
    start = [f"checkpoint.pretrained_checkpoint={initial_weights}"] if initial_weights else []
    return [*SMALL_MODEL, f"train.train_iters={steps}", f"optimizer.lr_decay_iters={SCHEDULE_ITERS}",
            "optimizer.lr_warmup_iters=0", f"logging.tensorboard_dir={tensorboard_dir}", *start]


@pytest.fixture(scope="session")
def single_process_reference(initial_weights, tmp_path_factory) -> Path:
    """TensorBoard dir of the 1-process run every parallel layout must reproduce."""
    tb = tmp_path_factory.mktemp("reference") / "tb"
    run_pretrain(1, [*parity_overrides(initial_weights, tb), *SINGLE_PROCESS])
    return tb


@pytest.fixture(scope="session")
def code_corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "train.jsonl", code_docs(200))


@pytest.fixture(scope="session")
def sentencepiece_model(code_corpus, tmp_path_factory) -> Path:
    """A 300-piece sentencepiece BPE trained on `code_corpus`."""
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    train_mod.train_tokenizer([str(code_corpus)], 300, "bpe", str(prefix))
    return Path(f"{prefix}.model")


@pytest.fixture(scope="session")
def unicode_corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("hf_corpus") / "c.jsonl", UNICODE_TEXTS)


@pytest.fixture(scope="session")
def byte_bpe_dir(unicode_corpus, tmp_path_factory) -> Path:
    """A 400-token Hugging Face byte-level BPE (tokenizer.json directory) trained on `unicode_corpus`."""
    out = tmp_path_factory.mktemp("hf_tok") / "byte_bpe"
    train_mod.main(["--input", str(unicode_corpus), "--vocab-size", "400", "--model-type", "byte-bpe",
                    "--output-prefix", str(out)])
    return out


@pytest.fixture(scope="module")
def megatron() -> Iterator[Callable[..., Any]]:
    """Runs a function in one spawned process that builds every megatron model of this module.

    Conversions build models in a world of one, and on CPU that installs megatron_ext.distributed.cpu_backend,
    which patches torch for the life of the process; the pytest process must stay unpatched for
    the other test files (test_cpu_backend checks that CUDA placement fails without it).
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda fn, *args, **kwargs: pool.submit(fn, *args, **kwargs).result()
