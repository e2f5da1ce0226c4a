"""One run per checkpoint directory. With auto-resume, two jobs started on the same ``checkpoint.save`` (a requeue
racing a manual relaunch, a job submitted twice) would resume the same iteration and interleave their saves, so a
run holds ``<checkpoint.save>/run.lock`` for its lifetime and a second run is refused with one line naming the
holder.

The lock is a file created with O_EXCL (atomic on local filesystems and on NFSv3+/Lustre/GPFS, where POSIX
``fcntl`` locks are not dependable) holding the holder's host, pid, SLURM job and step and the launch's rendezvous id;
a heartbeat thread refreshes its modification time. Whether the holder lives is asked first: a holder on this host
whose process exists keeps the lock (two plain ``torchrun`` launches share the run id ``none``, two steps of one
SLURM allocation share the job id). Otherwise the lock is stale, and is taken over with one warning, when its holder
was this same SLURM job step (an earlier start of a requeued job: SLURM never runs two at once) or an earlier world
of this same elastic launch, when its process is gone on this host, or when its heartbeat stopped more than
:data:`STALE_AFTER_S` ago (a dead job on another host).

A holder whose lock was taken over notices: its heartbeat stops refreshing a file that no longer names it, and
:meth:`RunLock.lost` says so before the run saves or deletes anything there.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Optional

import psutil

from megatron_ext.checkpoint.layout import RUN_LOCK
from megatron_ext.errors import CheckpointError, CheckpointStorageError
from megatron_ext.storage import files
from megatron_ext.storage.files import AnyPath

log = logging.getLogger("megatron_ext")

HEARTBEAT_S = 20.0  # how often a holder refreshes its lock
STALE_AFTER_S = 120.0  # a lock not refreshed for this long belongs to a dead run on another host


_DEFAULT_RUN_ID = "none"  # torchrun's --rdzv-id when none is given: shared by unrelated launches


def _identity(elastic_run_id: Optional[str] = None) -> dict[str, Any]:
    """Who takes the lock; `elastic_run_id`: the launcher's --rdzv-id (its ranks read TORCHELASTIC_RUN_ID)."""
    run_id = elastic_run_id or os.environ.get("TORCHELASTIC_RUN_ID")
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
            "elastic_run_id": run_id if run_id != _DEFAULT_RUN_ID else None,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def describe(holder: dict[str, Any]) -> str:
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('started')}"


def _pid_alive(pid: int) -> bool:
    """A process `pid` runs on this host. A zombie does not: a SIGKILLed rank whose launcher died with it waits to be
    reaped by init, and a relaunch that comes first must still take over its lock."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's live process
        return True


def stale_reason(holder: dict[str, Any], age_s: float, me: dict[str, Any]) -> Optional[str]:
    """Why the run that wrote `holder` (refreshed `age_s` ago) no longer holds it, or None while it may."""
    if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int):
        if not _pid_alive(holder["pid"]):
            return f"process {holder['pid']} no longer exists on {me['host']}"
        if age_s <= STALE_AFTER_S:  # alive and refreshing: whatever ids it shares with this run
            return None
    if me.get("slurm_job_id") and (holder.get("slurm_job_id"), holder.get("slurm_step_id")) == (
            me["slurm_job_id"], me.get("slurm_step_id")):
        return f"it was an earlier start of this SLURM job {me['slurm_job_id']}"
    if me.get("elastic_run_id") and holder.get("elastic_run_id") == me["elastic_run_id"]:
        # torchrun restarted the workers (a lost or a joining node): the same launch, on a new world
        return f"it was an earlier world of this elastic job (run id {me['elastic_run_id']})"
    if age_s > STALE_AFTER_S:
        return f"it was last refreshed {age_s:.0f} s ago"
    return None


def _read(path: AnyPath) -> Optional[tuple[dict[str, Any], float]]:
    """(holder, seconds since its last refresh), None when there is no lock."""
    try:
        text, mtime = path.read_text(), path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:  # a holder killed while writing it
        holder = {}
    return holder, time.time() - mtime


def holder_of(root: str | AnyPath, elastic_run_id: Optional[str] = None) -> Optional[str]:
    """The one-line refusal while a live run holds `root`, else None (the launcher's check before ranks start; a
    node joining an elastic job passes the job's run id, and the job's own lock lets it in)."""
    path = files.at(root) / RUN_LOCK
    found = _read(path)
    me = _identity(elastic_run_id)
    if found is None or stale_reason(*found, me) is not None:
        return None
    if elastic_run_id and found[0].get("elastic_run_id") == me["elastic_run_id"]:
        return None  # the live job this launch joins (the join restarts its workers, which take the lock over)
    return _refusal(path, *found)


def _refusal(path: AnyPath, holder: dict[str, Any], age_s: float) -> str:
    return (f"checkpoint.save={path.parent} is in use by another run ({describe(holder)}; {path} refreshed "
            f"{age_s:.0f} s ago): wait for it or stop it, or choose another checkpoint.save. The lock of a run that "
            f"died is taken over by the next launch (on another host once it is {STALE_AFTER_S:.0f} s old)")


class RunLock:
    """The lock on one checkpoint directory, held from :meth:`acquire` to :meth:`release` (by rank 0)."""

    def __init__(self, root: str | AnyPath):
        self.path = files.at(root) / RUN_LOCK
        self.me = _identity()
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None

    def acquire(self) -> None:
        """Take the lock, or take over a stale one; raises CheckpointError naming a live holder, or the directory
        when it cannot be written."""
        try:
            self._acquire()
        except OSError as e:
            raise CheckpointStorageError(
                f"checkpoint.save={self.path.parent} cannot be written ({type(e).__name__}: {e.strerror or e}): make "
                "it writable by this job's user or choose another checkpoint.save") from None
        self._heartbeat = threading.Thread(target=self._refresh, name="run-lock-heartbeat", daemon=True)
        self._heartbeat.start()

    def _acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a lock that disappears between a failed create and its read: try again
            if self._create():
                break
            found = _read(self.path)
            if found is None:
                continue
            reason = stale_reason(*found, self.me)
            if reason is None:
                raise CheckpointError(_refusal(self.path, *found))
            if self._take_over(found[0]):
                log.warning(f"took over {self.path} from {describe(found[0])}: {reason}")
                break
        else:
            raise CheckpointError(f"{self.path}: could not take the run lock (another run keeps replacing it)")

    def _create(self) -> bool:
        return files.create_exclusively(self.path, json.dumps(self.me))

    def _take_over(self, stale: dict[str, Any]) -> bool:
        """Move the stale lock aside and create ours. Of two runs taking over together, the second moves aside the
        first's fresh lock, sees it is not the stale one, and puts it back: only one of them proceeds."""
        aside = self.path.with_name(f"{RUN_LOCK}.{self.me['host']}.{self.me['pid']}")
        try:
            self.path.rename(aside)
        except FileNotFoundError:
            return False
        moved = _read(aside)
        if moved is not None and moved[0] != stale:
            aside.rename(self.path)
            return False
        aside.unlink(missing_ok=True)
        return self._create()

    def _refresh(self) -> None:
        """Keep the lock fresh while it names this run; stop once another run took it over (:meth:`lost`)."""
        while not self._stop.wait(HEARTBEAT_S):
            if self.lost() is not None:
                return
            try:
                files.refresh(self.path)
            except OSError:  # the directory went away; the run's own saves will say so
                return

    def lost(self) -> Optional[str]:
        """None while the lock file names this run; else the one line saying who took it (one small read)."""
        found = _read(self.path)
        if found is not None and found[0] == self.me:
            return None
        by = f"by {describe(found[0])}" if found is not None and found[0] else "(the lock file is gone)"
        return (f"checkpoint.save={self.path.parent} was taken over {by} while this run held it: stopping "
                f"without saving or deleting anything there. Two runs were using one checkpoint directory; "
                f"let the other finish, or give this run its own checkpoint.save")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self._stop.set()
        if self._heartbeat is None:
            return
        found = _read(self.path)
        if found is not None and found[0] == self.me:
            self.path.unlink(missing_ok=True)
        self._heartbeat = None
