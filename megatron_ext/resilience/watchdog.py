"""Hang watchdog: when no training step finishes for ``train.hang_timeout_s``, every live rank writes its Python
stacks to its log, the ranks whose heartbeat stopped are named once, and the job ends with EXIT_HUNG (the SLURM
templates requeue it; it resumes from the last checkpoint).

Under NVIDIA Resiliency Extension's ft_launcher the same step boundaries (and the ends of a checkpoint save) are
also its rank monitor's heartbeats (:mod:`.nvrx`).

Armed after the first step (start-up, compilation and communicator set-up are bounded by
``parallel.distributed_timeout_minutes``). While a checkpoint is written (or loaded for a rewind) the step timeout
does not apply, so a long save is not taken for a hang; the save is timed against the ceiling instead (the collective
timeout less its margin, which the planner sets above its checkpoint write time), and one that outlasts it (a
stopped or dead save helper, a file system that does not answer) is the hang, named as the save. A thread per rank bumps a heartbeat counter in the job's store every interval: a rank that is
stopped, dead or stuck outside Python stops bumping it, while ranks merely waiting for it in a collective do not.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

from megatron_ext.config.schema import HANG_MARGIN
from megatron_ext.distributed.store_keys import heartbeat_key, process_key
from megatron_ext.errors import EXIT_HUNG
from megatron_ext.resilience import flight_recorder
from megatron_ext.resilience.failures import RANK_LOG, rank_log, write_rank_log
from megatron_ext.resilience.job_store import job_store
from megatron_ext.resilience.nvrx import RankMonitorHeartbeats


class HangWatchdog:
    """One per rank; `step_done` after every step, `timed(what)` around checkpoint saves and loads, `close` at the end.

    A save or load is not a step: while one runs the step timeout does not apply, but it may not last beyond
    `io_limit_s` (:func:`~megatron_ext.planner.timeouts.checkpoint_io_limit_s`: a multiple of the planned write, at
    least the step timeout, at most the ceiling) before the watchdog ends the job naming it. The timeout widens to ``HANG_MARGIN`` times the longest stretch between finished steps seen so far (a run
    slower than planned is not taken for hung), never beyond `ceiling_s` (below the collective timeout, so that the
    watchdog still speaks first)."""

    def __init__(self, timeout_s: Optional[float], log_dir: str | Path, rank: int, world_size: int,
                 ceiling_s: Optional[float] = None, io_limit_s: Optional[float] = None):
        self.timeout_s, self.log_dir, self.rank, self.world_size = timeout_s, log_dir, rank, world_size
        self.ceiling_s = max(ceiling_s, timeout_s) if ceiling_s and timeout_s else timeout_s
        self.io_limit_s = min(io_limit_s, self.ceiling_s) if io_limit_s and self.ceiling_s else self.ceiling_s
        self.longest_stretch_s = 0.0
        self.interval = min(max((timeout_s or 0) / 10, 1.0), 10.0)  # >= 1 s: a loaded host still beats in time
        self.iteration = 0
        self._last_progress: Optional[float] = None  # None until the first step: not armed
        self._phase: Optional[tuple[str, float]] = None  # (what, its start) while a save or load runs
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store = None
        self._beats = 0
        self._launcher_heartbeats = RankMonitorHeartbeats()

    def start(self, iteration: int) -> None:
        if not self.timeout_s:
            return
        self.iteration = iteration
        self._store = job_store(timeout_s=max(self.interval * 2, 5.0))
        if self._store is not None:
            self._store.set(process_key(self.rank), f"{socket.gethostname()} {os.getpid()}")
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._thread.start()

    def step_done(self, iteration: int) -> None:
        now = time.monotonic()
        if self.timeout_s and self._last_progress is not None and self._phase is None:
            self._widen(now - self._last_progress)
        self.iteration, self._last_progress = iteration, now
        self._launcher_heartbeats.beat()

    def _widen(self, stretch_s: float) -> None:
        if stretch_s > self.longest_stretch_s:
            self.longest_stretch_s = stretch_s
            self.timeout_s = min(max(self.timeout_s, HANG_MARGIN * stretch_s), self.ceiling_s)

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        """Around `what` (a checkpoint save or load, named for the hang line): timed against the ceiling, not the
        step timeout."""
        self._phase = (what, time.monotonic())
        try:
            yield
        finally:
            self._phase = None
            if self._last_progress is not None:
                self._last_progress = time.monotonic()
            self._launcher_heartbeats.beat()

    def close(self) -> None:
        self._launcher_heartbeats.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 2)

    # -- the thread ------------------------------------------------------------------------------------------

    def _beat(self) -> None:
        self._beats += 1
        with contextlib.suppress(RuntimeError, OSError):
            if self._store is not None:
                self._store.set(heartbeat_key(self.rank), f"{self._beats} {self.iteration}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()
            last, phase = self._last_progress, self._phase
            if phase is not None:
                if time.monotonic() - phase[1] > self.io_limit_s:
                    self._fire(phase[0])
            elif last is not None and time.monotonic() - last > self.timeout_s:
                self._fire()

    def _heartbeats(self) -> dict[int, str]:
        beats = {}
        for rank in range(self.world_size):
            with contextlib.suppress(RuntimeError, OSError):
                if self._store.check([heartbeat_key(rank)]):
                    beats[rank] = self._store.get(heartbeat_key(rank)).decode()
        return beats

    def _fire(self, phase: Optional[str] = None) -> None:
        where = phase or f"iteration {self.iteration + 1}"
        silence = (f"{phase} has not finished in {self.io_limit_s:g} s" if phase else
                   f"no step finished for {self.timeout_s:g} s (the longest stretch before: "
                   f"{self.longest_stretch_s:.1f} s)")
        write_rank_log(self.log_dir, self.rank, where, f"hang watchdog: {silence}; Python stacks of every thread follow")
        with contextlib.suppress(OSError), open(rank_log(self.log_dir, self.rank), "a") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        flight_recorder.dump(self.log_dir, self.rank)
        stopped, behind, procs = [], {}, {}
        if self._store is not None:
            before = self._heartbeats()
            for _ in range(3):  # every live rank, firing too or not, bumps its counter at least twice meanwhile
                time.sleep(self.interval)
                self._beat()
            after = self._heartbeats()
            stopped = [r for r in range(self.world_size)
                       if r != self.rank and (r not in after or before.get(r) == after[r])]
            behind = {r: int(v.split()[1]) for r, v in after.items()
                      if r not in stopped and int(v.split()[1]) < self.iteration}
            procs = self._processes(stopped)
            self._kill_local(procs)
        live = [r for r in range(self.world_size) if r not in stopped]
        if self.rank == min(live):
            print(self._message(where, stopped, behind, procs, phase), file=sys.stderr, flush=True)
        self._beat()  # a last bump: a peer still sampling must not take this exit for a stopped rank
        os._exit(EXIT_HUNG)

    def _processes(self, ranks: list[int]) -> dict[int, tuple[str, int]]:
        """(host, pid) of each of `ranks` that registered one at start."""
        procs = {}
        for rank in ranks:
            with contextlib.suppress(RuntimeError, OSError, ValueError):
                host, pid = self._store.get(process_key(rank)).decode().split()
                procs[rank] = (host, int(pid))
        return procs

    @staticmethod
    def _kill_local(procs: dict[int, tuple[str, int]]) -> None:
        """End stopped ranks on this host: a SIGSTOPped process ignores the launcher's SIGTERM, and the job must go."""
        for host, pid in procs.values():
            if host == socket.gethostname():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def _message(self, where: str, stopped: list[int], behind: dict[int, int],
                 procs: dict[int, tuple[str, int]], phase: Optional[str] = None) -> str:
        lines = [f"[rank {self.rank}, {where}] hang: " + (
            f"{phase} has not finished in {self.io_limit_s:g} s (its limit: ten times the planned checkpoint write, at "
            "least train.hang_timeout_s, at most the collective timeout, parallel.distributed_timeout_minutes, less its "
            "margin)"
            if phase else f"no training step finished for {self.timeout_s:g} s (train.hang_timeout_s) after "
                          f"iteration {self.iteration}")]
        if stopped:
            named = [f"rank {r} (host {procs[r][0]}, pid {procs[r][1]})" if r in procs else f"rank {r}"
                     for r in stopped]
            lines.append(f"  heartbeat stopped on {', '.join(named)}: that process is stopped, dead or stuck "
                         "outside Python; the other ranks wait for it")
        elif phase:
            lines.append("  every rank's heartbeat is alive: a rank's save waits on its writer (a stopped or dead "
                         "checkpoint save helper, a file system that does not answer) while the others wait for it; "
                         "the stacks show where")
        else:
            lines.append("  every rank's heartbeat is alive: they all wait in a collective that never completes "
                         "(a stuck device or network); the stacks show where")
        if behind:
            lines.append("  behind the others: " + ", ".join(f"rank {r} at iteration {i}" for r, i in behind.items()))
        lines.append(f"  → Python stacks of the live ranks: {Path(self.log_dir) / RANK_LOG.format(rank='*')}; the job ends "
                     f"(exit {EXIT_HUNG}) so that SLURM requeues it and it resumes from the last checkpoint")
        lines.append(f"  → the collective each live rank was in: python -m torch.distributed.flight_recorder.fr_trace "
                     f"{self.log_dir} --prefix {flight_recorder.PREFIX} --allow-incomplete-ranks (torch's flight "
                     "recorder, one dump per live rank)")
        return "\n".join(lines)
