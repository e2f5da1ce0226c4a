"""One imported interpreter for the whole test session: ``python -m tests.zygote -m MODULE [args]`` runs MODULE as
``python -m MODULE [args]`` would, but in a process forked from a server that imported torch, megatron-core and the
trainer once, so the ~4 s of CPU every Python process here spends importing them is spent once per session.

The client (this module without the server's imports: it starts in milliseconds) sends its arguments, working
directory, environment and standard streams (the file descriptors themselves) to the server, which forks a child that
takes them and runs the module; the client forwards SIGTERM, SIGINT, SIGHUP and SIGUSR1 to it and exits as it did
(a child ended by a signal ends the client by the same signal). A client that dies (a test's timeout kills it) takes
its child with it. Without a server (no ``TESTS_ZYGOTE_SOCKET``, or none answering) the client becomes
``python -m MODULE [args]`` itself.

Used by the runs whose subject is not process start-up (tests/launch.py): the modules a child runs were imported
before its environment was set, so code that reads the environment at import time would see the server's. The
launchers and start-up paths keep real launches (test_failures, test_elastic, test_slurm, test_quickstart,
test_config, test_checkpoint_safety's torchrun cases).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

SOCKET_ENV = "TESTS_ZYGOTE_SOCKET"
# what the server imports before it serves: what every recipe run and test worker imports
PRELOAD = ("megatron_ext.training.trainer", "recipes.pretrain", "tests.fork_launch")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
_MAX_MESSAGE = 1 << 20


def start_server(path: str, env: dict[str, str]) -> subprocess.Popen:
    """The server, in the background, serving on the Unix socket `path` once it has imported PRELOAD."""
    return subprocess.Popen([sys.executable, "-m", "tests.zygote", "--serve", path], env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _serve(path: str) -> None:
    import importlib

    from megatron_ext.resilience.process_guard import die_with_parent

    die_with_parent(signal.SIGKILL)  # a test session killed outright takes its server along

    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients see the socket only once it accepts
    listener.listen(64)
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    while True:
        connections = {conn.fileno(): (pid, conn) for pid, conn in children.items()}
        ready, _, _ = select.select([listener, *[c for _, c in connections.values()]], [], [], 0.02)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                pid = _fork_child(listener, conn, children)
                if pid:
                    children[pid] = conn
                    conn.send(f"pid {pid}".encode())
            elif not sock.recv(64):  # the client is gone: so is its run
                pid, _ = connections[sock.fileno()]
                _kill(pid, signal.SIGKILL)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            except OSError:
                pass
            conn.close()


def _kill(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _fork_child(listener: socket.socket, conn: socket.socket, children: dict[int, socket.socket]) -> int:
    message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
    if len(fds) != 3:
        conn.close()
        return 0
    request = json.loads(message)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    listener.close()
    for other in children.values():
        other.close()
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin, sys.stdout, sys.stderr = (open(0, closefd=False), open(1, "w", closefd=False),
                                         open(2, "w", closefd=False))
    os.chdir(request["cwd"])
    os.environ.clear()
    from tests.fork_launch import run_as_main

    run_as_main(request["module"], request["args"], request["env"])


def _client(module: str, args: list[str]) -> None:
    path = os.environ.get(SOCKET_ENV)
    conn = _connect(path) if path else None
    if conn is None:
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    request = {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    child = int(conn.recv(64).split()[1])
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: _kill(child, signum))
    reply = conn.recv(64)  # the child's end; b"" when the server is gone (a recv at EOF returns at once, forever)
    if not reply:
        _kill(child, signal.SIGKILL)
        raise SystemExit("tests.zygote: the server ended before the run did (the test session was stopped?)")
    code = int(reply.split()[1])
    if code < 0:  # ended by a signal: so is the client
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _connect(path: str, wait_s: float = 120.0) -> socket.socket | None:
    """A connection to the server at `path`, waiting while it imports; None when none comes up."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(path)
                return conn
            except OSError:
                conn.close()
                return None
        time.sleep(0.05)
    return None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "-m":
        _client(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit("usage: python -m tests.zygote -m MODULE [args]  |  --serve SOCKET")
