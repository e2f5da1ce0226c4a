"""`make test`'s worker count (tests/xdist_workers.py): from the cores this process may use, a cgroup quota, memory."""

from __future__ import annotations

from tests import xdist_workers


def test_two_workers_on_small_machines_half_the_cores_on_large_and_fewer_when_memory_is_short():
    assert xdist_workers.workers(2, 23.4) == 2  # the CI-sized VM
    assert xdist_workers.workers(4, 64) == 2
    assert xdist_workers.workers(16, 128) == 8
    assert xdist_workers.workers(16, 30) == 3  # 8 GiB each
    assert xdist_workers.workers(2, 6) == 1


def test_a_cgroup_quota_limits_the_cores_a_container_on_a_large_host_sees(tmp_path, monkeypatch):
    monkeypatch.setattr(xdist_workers.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(xdist_workers, "CPU_MAX", tmp_path / "cpu.max")
    assert xdist_workers.usable_cores() == 64  # no cgroup v2 file
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert xdist_workers.usable_cores() == 64
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    assert xdist_workers.usable_cores() == 2
