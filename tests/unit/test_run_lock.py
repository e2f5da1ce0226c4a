"""One run per checkpoint directory: the run lock's create, refuse and take-over rules (one process)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_ext.checkpoint import run_lock
from megatron_ext.checkpoint.layout import RUN_LOCK
from megatron_ext.checkpoint.run_lock import RunLock, holder_of
from megatron_ext.errors import CheckpointError


def _write(root, age_s: float = 0.0, **holder) -> None:
    path = root / RUN_LOCK
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None,
                                "started": "2026-01-01 00:00:00", **holder}))
    then = time.time() - age_s
    os.utime(path, (then, then))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def zombie_pid():
    """A child that has exited and is not reaped yet: a SIGKILLed rank whose launcher died with it, before init reaps
    it."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    while run_lock.psutil.Process(proc.pid).status() != run_lock.psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    yield proc.pid
    proc.wait()


def test_a_lock_is_created_refused_while_held_and_removed_on_release(tmp_path):
    first = RunLock(tmp_path / "ckpt")
    first.acquire()
    assert json.loads((tmp_path / "ckpt" / RUN_LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(CheckpointError, match=f"is in use by another run \\(pid {os.getpid()} on "):
        RunLock(tmp_path / "ckpt").acquire()
    assert "in use by another run" in holder_of(tmp_path / "ckpt")
    first.release()
    assert not (tmp_path / "ckpt" / RUN_LOCK).exists() and holder_of(tmp_path / "ckpt") is None


@pytest.mark.parametrize("holder, env, why", [
    ({"pid": "dead"}, {}, "no longer exists on"),
    ({"pid": "zombie"}, {}, "no longer exists on"),
    ({"host": "other-node"}, {}, "last refreshed"),
    ({"host": "other-node", "slurm_job_id": "77"}, {"SLURM_JOB_ID": "77"}, "earlier start of this SLURM job 77"),
])
def test_a_stale_lock_is_taken_over_with_one_warning(tmp_path, monkeypatch, caplog, request, holder, env, why):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if holder.get("pid") == "dead":
        holder["pid"] = _dead_pid()
    if holder.get("pid") == "zombie":
        holder["pid"] = request.getfixturevalue("zombie_pid")
    age = run_lock.STALE_AFTER_S + 10 if holder.get("host") == "other-node" and not env else 0.0
    _write(tmp_path, age, **holder)
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="megatron_ext"):
        lock.acquire()
    assert [r.getMessage() for r in caplog.records if why in r.getMessage()], caplog.text
    assert json.loads((tmp_path / RUN_LOCK).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_fresh_lock_of_another_host_is_respected(tmp_path):
    _write(tmp_path, 5.0, host="other-node", slurm_job_id="12")
    with pytest.raises(CheckpointError, match="pid .* on other-node, SLURM job 12"):
        RunLock(tmp_path).acquire()


def test_a_lock_replaced_during_a_take_over_is_put_back(tmp_path):
    """The loser of two take-overs finds a lock that is not the stale one it judged, and restores it."""
    _write(tmp_path, pid=_dead_pid())
    stale = json.loads((tmp_path / RUN_LOCK).read_text())
    _write(tmp_path, host="winner")  # the other run's fresh lock, written after this one read the stale
    winner = (tmp_path / RUN_LOCK).read_text()
    assert RunLock(tmp_path)._take_over(stale) is False
    assert (tmp_path / RUN_LOCK).read_text() == winner


@pytest.mark.parametrize("env", [{"TORCHELASTIC_RUN_ID": "none"}, {"TORCHELASTIC_RUN_ID": "job-7"},
                                 {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}])
def test_a_live_holder_on_this_host_keeps_the_lock_whatever_ids_it_shares(tmp_path, monkeypatch, env):
    """Two plain torchrun launches share the run id 'none'; ids are compared only once the holder is not alive."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    holder = RunLock(tmp_path)
    holder.acquire()  # this process: alive, on this host, with the same ids as the next one
    try:
        with pytest.raises(CheckpointError, match="is in use by another run"):
            RunLock(tmp_path).acquire()
    finally:
        holder.release()


def test_another_step_of_the_same_slurm_job_is_refused_and_a_requeued_start_takes_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    _write(tmp_path, 5.0, host="other-node", slurm_job_id="77", slurm_step_id="0")
    with pytest.raises(CheckpointError, match="SLURM job 77"):
        RunLock(tmp_path).acquire()
    _write(tmp_path, 5.0, host="other-node", slurm_job_id="77", slurm_step_id="1")
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_a_holder_whose_lock_was_taken_over_notices_and_stops_refreshing_it(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.02)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.lost() is None
    _write(tmp_path, run_lock.STALE_AFTER_S / 2, host="other-node", slurm_job_id="12")  # the run that took it
    time.sleep(0.2)
    age = time.time() - (tmp_path / RUN_LOCK).stat().st_mtime
    assert age > run_lock.STALE_AFTER_S / 4, "the old holder's heartbeat refreshed the new holder's lock"
    assert lock.lost().startswith(f"checkpoint.save={tmp_path} was taken over by pid ") and "other-node" in lock.lost()
    lock.release()
    assert (tmp_path / RUN_LOCK).exists()  # not ours to remove


def test_a_checkpoint_directory_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError) as error:
        RunLock(tmp_path / "a-file" / "ckpt").acquire()
    assert str(error.value).startswith(f"checkpoint.save={tmp_path / 'a-file' / 'ckpt'} cannot be written "
                                       "(NotADirectoryError: Not a directory): make it writable"), error.value
    assert error.value.exit_code == 6


def test_a_launch_joining_the_live_elastic_job_that_holds_the_lock_is_let_in(tmp_path):
    """A node joining an elastic job checks the lock before its workers start: the job's own live rank 0 (on this
    host, in the tests) holds it. The join goes ahead; another launch is refused."""
    _write(tmp_path, 5.0, elastic_run_id="job-7")  # this process: alive, on this host
    assert holder_of(tmp_path, elastic_run_id="job-7") is None
    assert "is in use by another run" in holder_of(tmp_path, elastic_run_id="job-8")
    assert "is in use by another run" in holder_of(tmp_path)


@pytest.mark.serial  # a heartbeat of 50 ms against a stale age of 0.5 s
def test_the_heartbeat_keeps_a_live_lock_from_another_hosts_take_over_and_stops_with_the_run(tmp_path, monkeypatch):
    """The holder refreshes its lock every HEARTBEAT_S, so a launch on another host is refused for as long as the run
    lives, however long that is; once the heartbeat stops (the run died without releasing), the lock ages past
    STALE_AFTER_S and that launch takes it over."""
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(run_lock, "STALE_AFTER_S", 0.5)

    def launch_on_another_host() -> RunLock:
        other = RunLock(tmp_path)
        other.me = {**other.me, "host": "other-node", "pid": 1}
        return other

    holder = RunLock(tmp_path)
    holder.acquire()
    for _ in range(3):  # three times the stale age: the heartbeat keeps it fresh
        time.sleep(0.5)
        assert time.time() - (tmp_path / RUN_LOCK).stat().st_mtime < 0.5
        with pytest.raises(CheckpointError, match="is in use by another run"):
            launch_on_another_host().acquire()
    holder._stop.set()  # the run died: no release, no more heartbeat
    time.sleep(0.8)
    other = launch_on_another_host()
    other.acquire()
    assert json.loads((tmp_path / RUN_LOCK).read_text())["host"] == "other-node"
    other.release()
