"""Test helpers: run the recipe entry point under torchrun and read back what it logged to TensorBoard."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal, Optional

from megatron_ext.metrics.run_logger import read_scalars  # noqa: F401 -- re-exported for the tests

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
# Directories the test session shares outside pytest's tmp_path; tests/conftest.py removes them when it ends.
SESSION_TEMP_DIRS: list[str] = []


def session_temp_dir(prefix: str) -> str:
    """A directory for the whole test session, removed with it (the machine's /tmp is not the tests' to fill). The
    processes the session starts that import this module find the session's own through the environment; each
    pytest-xdist worker is a session of its own (its runs' GPTDataset caches and rank logs are not another's)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    variable = "TESTS_SESSION_DIR_" + f"{prefix.strip('-')}-{worker}".strip("-").replace("-", "_").upper()
    if variable not in os.environ:
        SESSION_TEMP_DIRS.append(tempfile.mkdtemp(prefix=prefix))
        os.environ[variable] = SESSION_TEMP_DIRS[-1]
    return os.environ[variable]


# megatron-core's GPTDataset index cache, shared by the session's runs: by default it would go next to the data,
# inside the repository (data/tiny/...), which no test may write into
DATASET_CACHE = session_temp_dir("gptdataset-cache-")
# Per-rank failure logs of runs whose test does not look at them.
RANK_LOGS = session_temp_dir("rank-logs-")

# A smaller shape than the default run so multi-process cases take seconds per step on 2 cores.
SMALL_MODEL = [
    "model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.ffn_hidden_size=384", "model.seq_length=128",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_iters=1", "train.eval_interval=1000",
    "optimizer.lr_warmup_iters=2", "logging.log_interval=1",
]
# A small bf16 Llama on random tokens on one GPU, for the GPU-only tests that compare two ways of training it.
ONE_GPU_SMALL = [
    "model.num_layers=2", "model.hidden_size=512", "model.num_attention_heads=8", "model.num_query_groups=4",
    "model.ffn_hidden_size=1536", "model.seq_length=512", "model.vocab_size=32000",
    "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
    "parallel.sequence_parallel=false", "train.precision=bf16", "train.micro_batch_size=2",
    "train.global_batch_size=4", "train.train_iters=8", "train.eval_iters=0", "optimizer.lr_warmup_iters=0",
    "data.mock=true", "data.blend=null", "data.tokenizer_model=null",
    "logging.log_interval=1",  # the tests read every step's loss off the console (tiny.yaml logs every 10th)
]
SINGLE_PROCESS = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                  "parallel.sequence_parallel=false"]


Launcher = Literal["fork", "torchrun", "recipes.launch"]


def launch_prefix(nproc: int, launcher: Launcher = "fork") -> list[str]:
    """How `nproc` ranks start, before ``-m MODULE``: for runs whose subject is not process start-up, forked from the
    session's imported interpreter (tests/zygote.py), `nproc` > 1 of them forked again by tests/fork_launch.py; or as
    a user starts them, by torchrun's agent. One process needs no launcher (the recipe starts a world of one)."""
    if launcher == "fork":
        return ["-m", "tests.zygote", *(["-m", "tests.fork_launch", f"--nproc-per-node={nproc}"] if nproc > 1 else [])]
    # --log-dir: its agent's per-rank error files, which it would put in a new directory under /tmp per launch
    return [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                                  f"--log-dir={RANK_LOGS}"]


def pretrain_command(nproc: int, overrides: list[str], module: str = "recipes.pretrain",
                     config: Optional[Path] = TINY, launcher: Launcher = "fork",
                     launch_options: tuple[str, ...] = ()) -> list[str]:
    """The command line: `module` on `nproc` processes (see launch_prefix; recipes.launch with
    `launch_options`)."""
    if launcher == "recipes.launch":
        start = ["-m", "recipes.launch", "--standalone", f"--nproc-per-node={nproc}", *launch_options]
    else:
        start = [*launch_prefix(nproc, launcher), "-m", module]
    return [sys.executable, *start, *(["--config", str(config)] if config else []),
            # never into the repository's runs/ (a test that saves or logs says where)
            "checkpoint.save=null", "logging.tensorboard_dir=null", f"logging.log_dir={RANK_LOGS}",
            f"data.path_to_cache={DATASET_CACHE}", *overrides]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on this machine now (for launches that must not share one)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}


def run_pretrain(nproc: int, overrides: list[str], timeout: int = 600, module: str = "recipes.pretrain",
                 config: Optional[Path] = TINY, check: bool = True, env: Optional[dict[str, str]] = None,
                 launcher: Launcher = "fork", launch_options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `module` (the recipe entry point, or a test wrapper of it) on `nproc` processes with `config` and
    `overrides`; with `check`, fails the test with the log if the run fails."""
    return _run(pretrain_command(nproc, overrides, module, config, launcher, launch_options), env, timeout, check)


def run_module(nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """``-m MODULE ARGS...`` on `nproc` processes started as :func:`launch_prefix` starts them; fails the test with
    the output if it fails."""
    return _run([sys.executable, *launch_prefix(nproc), *args], None, timeout, check=True)


def _run(cmd: list[str], env: Optional[dict[str, str]], timeout: int, check: bool) -> subprocess.CompletedProcess:
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                             + _rank_logs_since(started, cmd))
    return proc


def _rank_logs_since(started: float, cmd: list[str]) -> str:
    """The tails of the rank logs this run wrote (tracebacks, hang stacks, a crashed rank's native-signal stack)."""
    log_dirs = [arg.split("=", 1)[1] for arg in cmd if arg.startswith("logging.log_dir=")]
    logs = sorted(Path(log_dirs[-1]).glob("rank-*.log")) if log_dirs else []
    return "".join(f"\n--- {log} ---\n{log.read_text()[-3000:]}" for log in logs if log.stat().st_mtime >= started)


def same_files(one: Path, other: Path) -> bool:
    """Whether two directories hold the same file names with the same bytes (a file at a time: exported models)."""
    names = sorted(p.name for p in one.iterdir())
    return names == sorted(p.name for p in other.iterdir()) and all(
        (one / n).read_bytes() == (other / n).read_bytes() for n in names)


def max_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


def steps_per_launch(tensorboard_dir: Path, tag: str) -> list[list[int]]:
    """The steps of `tag` in each event file of the directory, oldest file first: one file per launch, so a resume
    shows as [[1..N], [N+1..]] where a restart from scratch would show [[1..N], [1..]] (read_scalars merges the
    files and cannot tell them apart)."""
    files = sorted(Path(tensorboard_dir).glob("events.out.tfevents.*"), key=lambda p: (int(p.name.split(".")[3]), p.name))
    return [sorted(read_scalars_of_file(f, tag)) for f in files]


def read_scalars_of_file(event_file: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}
