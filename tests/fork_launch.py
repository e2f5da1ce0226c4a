"""The suite's launcher for multi-process runs whose subject is not the launcher: ``python -m tests.fork_launch
--nproc-per-node=N -m MODULE [args]`` starts N ranks of MODULE as torchrun does (same environment variables, each
rank in its own session, the others stopped when one fails, exit 1 then, what is left of each session killed at the
end), but forks them from this process after it
has imported torch, megatron-core and the trainer once.

Why: on the 2-core CI machine a rank spends ~5 s of CPU importing, so a 4-process torchrun launch spends more time
importing than training; forking copies the imported interpreter for nothing. The ranks then run exactly the code
torchrun's ranks run (the module as ``__main__``), but their imports happened before RANK and the other variables
were set, and they share this interpreter's hash seed. The launchers themselves (torchrun, ``recipes.launch``,
NVRx, SLURM) are tested with real launches in test_failures, test_elastic, test_slurm, test_checkpoint_safety and
test_config.
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import socket
import sys
import time
import traceback
import uuid

# A stopped run's ranks get this long to end after SIGTERM before SIGKILL (torchrun's agent waits 30 s).
STOP_GRACE_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_environment(rank: int, world_size: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun's agent sets for a rank of a one-node standalone run (the agent's own store aside)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "ROLE_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run_as_main(module: str, argv: list[str], env: dict[str, str]) -> None:
    """In a forked child: become a process of its own session with default signal handling and `env` added to its
    environment, and run `module` as ``python -m module argv`` would; never returns."""
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(env)
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def launch(nproc: int, module: str, argv: list[str]) -> int:
    """Fork `nproc` ranks of `module`, wait for them; 0 when all end with 0, else 1 after stopping the rest."""
    importlib.import_module("megatron_ext.training.trainer")
    importlib.import_module(module)  # its own imports; the rank runs it again as __main__
    port, run_id = _free_port(), uuid.uuid4().hex
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            run_as_main(module, argv, _rank_environment(rank, nproc, port, run_id))
        ranks[pid] = rank
    signal.signal(signal.SIGTERM, lambda *_: _stop(set(ranks), signal.SIGTERM))
    failed: list[tuple[int, int]] = []
    running, deadline = set(ranks), None
    while running:
        if deadline is not None and time.monotonic() > deadline:
            _stop(running, signal.SIGKILL)
        pid, status = os.waitpid(-1, os.WNOHANG if deadline is not None else 0)
        if pid == 0:
            time.sleep(0.1)
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed.append((ranks[pid], code))
            _stop(running, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
    for pid in ranks:  # what is left of each rank's session (its helper processes), as torchrun's agent kills it
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if failed:
        rank, code = failed[0]
        print(f"tests.fork_launch: rank {rank} (local_rank: {rank}) failed first, exitcode : {code}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """``--nproc-per-node=N -m MODULE ARGS...``: everything after the module is the module's."""
    if len(argv) < 3 or not argv[0].startswith("--nproc-per-node=") or argv[1] != "-m":
        raise SystemExit(f"usage: python -m tests.fork_launch --nproc-per-node=N -m MODULE [args]; got {argv}")
    return launch(int(argv[0].split("=", 1)[1]), argv[2], argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
