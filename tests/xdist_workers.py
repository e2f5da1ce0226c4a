"""How many pytest-xdist workers `make test` starts on this machine: two on up to 4 cores (a test file's runs keep
about two busy), half the cores above that; fewer where a cgroup CPU quota allows fewer cores than the machine shows
(a container on a large host, where `nproc` counts the host's) or memory is short (a worker's session holds an
imported interpreter and runs up to four ranks: 8 GiB allowed per worker)."""

from __future__ import annotations

import math
import os
from pathlib import Path

GIB_PER_WORKER = 8
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>", or "max <period>" for no quota


def usable_cores() -> int:
    cores = len(os.sched_getaffinity(0))
    if CPU_MAX.is_file():
        limit, period = CPU_MAX.read_text().split()
        if limit != "max":
            cores = min(cores, max(1, math.ceil(int(limit) / int(period))))
    return cores


def workers(cores: int, memory_gib: float) -> int:
    by_cores = 2 if cores <= 4 else cores // 2
    return max(1, min(by_cores, int(memory_gib // GIB_PER_WORKER)))


if __name__ == "__main__":
    print(workers(usable_cores(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30))
