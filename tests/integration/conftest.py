"""The integration tests' session: one imported interpreter serves their recipe runs (tests/zygote.py)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from typing import Iterator

import pytest

from tests.launch import run_env
from tests.zygote import SOCKET_ENV, start_server


@pytest.fixture(scope="session", autouse=True)
def zygote() -> Iterator[None]:
    """Started with the first integration test, stopped with the session; its runs see its socket through the
    environment they inherit. Its temporary directory is its own, removed with it: what its imports make there
    (wandb's two directories, which megatron-core's timers import) and what its forked runs leave (multiprocessing's
    pymp-* of a rank that ends with os._exit) is not the machine's /tmp."""
    directory = tempfile.mkdtemp(prefix="zygote-")
    path = os.path.join(directory, "server.sock")
    server = start_server(path, run_env({"TMPDIR": directory}))
    os.environ[SOCKET_ENV] = path
    try:
        yield
    finally:
        del os.environ[SOCKET_ENV]
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        shutil.rmtree(directory, ignore_errors=True)
