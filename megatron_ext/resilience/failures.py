"""One message per failure: the rank that knows prints one line (rank, where, what happened, what to do); the
full traceback goes to that rank's log file, which the line names. Exit codes say which kind it was."""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import signal
import socket
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Iterator, Optional

from megatron_ext.distributed.store_keys import failure_key
from megatron_ext.errors import (
    EXIT_FAILED,
    EXIT_PEER_FAILED,
    EXIT_STORAGE,
    STORAGE_ERRNOS,
    RecipeError,
    signal_exit_code,
)

# What torch.distributed raises on the survivors when a peer process dies: a consequence, not the cause.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
              "ProcessGroupNCCL is aborted", "Broken pipe", "Socket closed")


RANK_LOG = "rank-{rank}.log"  # each rank's log in the run's log directory


def rank_log(log_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its tracebacks and hang stacks: under `log_dir` (logging.log_dir), or where that cannot
    be written (a read-only mount, a vanished directory) under this machine's temporary directory, in a directory
    named for it — the same rule for the rank that writes and the launcher that points at it, so a failure's
    traceback is always kept and found."""
    return writable_log_dir(log_dir) / RANK_LOG.format(rank=rank)


def writable_log_dir(log_dir: str | Path) -> Path:
    """`log_dir` when this process can write there (made if missing), else its stand-in under the temporary
    directory (see :func:`rank_log`)."""
    wanted = Path(log_dir)
    try:
        wanted.mkdir(parents=True, exist_ok=True)
        if os.access(wanted, os.W_OK):
            return wanted
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "megatron_ext-logs" / str(wanted.absolute()).strip("/").replace("/", "_")


@contextlib.contextmanager
def fatal_signal_stacks_logged(log_dir: str | Path, rank: int) -> Iterator[None]:
    """While inside: a rank ended by SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT (in native code: gloo, NCCL, a
    kernel) leaves every thread's Python stack in its log; otherwise the console shows only the launcher's
    "exitcode -11". The log is opened ahead (faulthandler writes to its descriptor from the signal handler) and
    removed again, with a directory made for it, if nothing was written."""
    import faulthandler

    path = rank_log(log_dir, rank)
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path, "a")
    except OSError:
        yield
        return
    faulthandler.enable(file=log, all_threads=True)
    try:
        yield
    finally:
        faulthandler.disable()
        log.close()
        with contextlib.suppress(OSError):
            if path.stat().st_size == 0:
                path.unlink()
                for directory in made:  # innermost first
                    directory.rmdir()


def _is_peer_loss(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.distributed.DistBackendError) or any(s in str(exc) for s in _PEER_LOST)


def _classify(exc: BaseException) -> tuple[str, int, str]:
    """(kind, exit code, what to do) for the console line."""
    import torch

    if isinstance(exc, RecipeError):
        return exc.kind, exc.exit_code, exc.advice
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of GPU memory", EXIT_FAILED, ""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", signal_exit_code(signal.SIGINT), ""
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "storage error", EXIT_STORAGE, ("free space there (or point checkpoint.save elsewhere) and "
                                                   "resume: checkpoints already complete are untouched")
        if exc.errno in STORAGE_ERRNOS:
            return "storage error", EXIT_STORAGE, "make that path writable (or choose another) and resume"
        return "I/O error", EXIT_FAILED, ""
    return type(exc).__name__, EXIT_FAILED, ""


SUMMARY_CHARS = 300


def _summary(exc: BaseException) -> str:
    """The exception's own message: whole for this project's errors (written to be read), else its first line.

    A first line that only introduces its cause (inductor's "backend='inductor' raised:") is said with the cause's
    line; a line too long keeps its head and its tail, where CUDA and cuDNN put the status code."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, RecipeError):
        return text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    if len(first) <= SUMMARY_CHARS:
        return first
    tail = SUMMARY_CHARS // 3
    return f"{first[:SUMMARY_CHARS - tail - 5]} ... {first[-tail:]}"


def write_rank_log(log_dir: str | Path, rank: int, where: str, body: str) -> Optional[Path]:
    """Append a dated section to the rank's log; None when it cannot be written (the caller prints instead)."""
    path = rank_log(log_dir, rank)
    header = (f"==== {datetime.datetime.now().isoformat(timespec='seconds')} rank {rank} "
              f"(host {socket.gethostname()}, pid {os.getpid()}), {where}\n")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(header + body + ("" if body.endswith("\n") else "\n"))
    except OSError:
        return None
    return path


def _first_to_say(text: str) -> bool:
    """True on exactly one rank per distinct message (the store counts who got there first); True without one."""
    from megatron_ext.resilience.job_store import job_store

    store = job_store(timeout_s=5.0)
    if store is None:
        return True
    try:
        return store.add(failure_key(text), 1) == 1
    except (RuntimeError, OSError):
        return True


def report_failure(exc: BaseException, rank: int, where: str, log_dir: str | Path,
                   advice: str = "") -> int:
    """Say `exc` once for the whole job and log its traceback; returns the process's exit code.

    `where`: "start-up", "iteration 12", "checkpoint save at iteration 12", ...; `advice`: what to do, from a
    caller that knows more than the exception (the OOM hint, say)."""
    from megatron_ext.resilience.process_guard import LauncherGone

    trace = "".join(traceback.format_exception(exc))
    if isinstance(exc, LauncherGone):  # nobody is left to read a console line
        write_rank_log(log_dir, rank, where, "the launcher died: stopped without a checkpoint\n" + trace)
        return exc.code if isinstance(exc.code, int) else EXIT_FAILED
    log_path = write_rank_log(log_dir, rank, where, trace)
    if _is_peer_loss(exc):
        return EXIT_PEER_FAILED  # the failed rank says why; the survivors only log
    kind, code, default_advice = _classify(exc)
    what = _summary(exc)
    todo = advice or default_advice
    message = f"{kind}: {what}" + (f"\n  → {todo}" if todo else "")
    if _first_to_say(message):
        where_line = f"[rank {rank}, {where}] {message}"
        if log_path is not None:
            where_line += f"\n  (traceback: {log_path})"
        else:
            where_line += "\n" + trace
        print(where_line, file=sys.stderr, flush=True)
    return code


def out_of_memory_advice(cfg, stage: int, world_size: int, device_bytes: int) -> str:
    """For an out-of-memory error: the rank's stage and micro batch beside the planner's estimate for this layout,
    and the ways out."""
    from megatron_ext.planner import GIB, model_vocab_size, stage_peak_bytes

    t = cfg.train
    estimate = stage_peak_bytes(cfg, model_vocab_size(cfg), world_size, stage) / GIB
    return (f"pipeline stage {stage} of {cfg.parallel.pipeline_model_parallel_size}, micro batch size "
            f"{t.micro_batch_size} × seq {cfg.model.seq_length}: the planner estimates {estimate:.1f} GiB peak for "
            f"this stage, the GPU has {device_bytes / GIB:.1f} GiB. Lower train.micro_batch_size, set "
            f"train.recompute_granularity=selective (or full), or raise TP/PP: python -m recipes.plan --config "
            f"<recipe> --gpus {world_size} lists the layouts that fit")
