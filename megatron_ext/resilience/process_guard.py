"""No orphans: a training rank or data worker ends within seconds of its launcher's death, even after ``kill -9``.

torchrun starts every rank in its own session, so a signal to the launcher's process group misses them, and a
SIGKILLed launcher cannot pass anything on. Linux's ``prctl(PR_SET_PDEATHSIG)`` asks the kernel to signal the
child when its parent dies; nothing in torch or the standard library exposes it, hence the ctypes call here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Optional

from megatron_ext.errors import signal_exit_code

_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2
# SIGHUP ("the controlling process hung up"), not SIGTERM: SIGTERM means "checkpoint and stop" to a training rank,
# and an orphan must not write a checkpoint.
PARENT_DEATH_SIGNAL = signal.SIGHUP
# After the parent's death, seconds a rank gets for its clean path (abort an async save, close its logs) before it
# is ended wherever it is (for example blocked in a collective with a dead peer).
ORPHAN_GRACE_S = 5


class LauncherGone(SystemExit):
    """Raised in a training rank whose launcher died: unwind (no checkpoint), then exit."""


def die_with_parent(sig: signal.Signals = PARENT_DEATH_SIGNAL) -> Optional[str]:
    """Have the kernel send `sig` to this process when its parent dies, and check that it took. Returns None, or
    why it could not be set (not Linux, or the parent already gone: then this process exits now)."""
    if not sys.platform.startswith("linux"):
        return f"{sys.platform} has no parent-death signal: stop this process yourself if its launcher dies"
    parent = os.getppid()
    if signal.getsignal(sig) == signal.SIG_IGN:  # inherited, e.g. under nohup: the kernel's signal would do nothing
        signal.signal(sig, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}"
    current = ctypes.c_int(0)
    libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(current), 0, 0, 0)
    if current.value != int(sig):
        return f"prctl(PR_SET_PDEATHSIG) did not take (reads back {current.value})"
    if parent == 1 or os.getppid() != parent:  # the parent died before the request was in place
        os._exit(signal_exit_code(sig))
    return None


_guarded_parent: Optional[int] = None
_launcher_gone_raised = False


def _on_parent_death(signum: int, _frame) -> None:
    """Raise LauncherGone once. The kernel signals a child again each time it is handed to another of the dying
    launcher's threads (two SIGHUPs within milliseconds from a SIGKILLed torchrun, measured with strace); a second
    raise would land in the first one's unwind, before the rank's log says why, and leave the rank silently."""
    global _launcher_gone_raised
    if _launcher_gone_raised:
        return
    _launcher_gone_raised = True
    raise LauncherGone(signal_exit_code(signum))


def raise_if_launcher_gone() -> None:
    """At a step boundary: stop a guarded rank whose launcher has died even when the signal's exception was lost
    (a signal handler that raises inside a finalizer run by the garbage collector is reported and dropped, and
    the rank would train on, saving checkpoints, until the backstop ends it)."""
    if _guarded_parent is not None and os.getppid() != _guarded_parent:
        raise LauncherGone(signal_exit_code(PARENT_DEATH_SIGNAL))


def _exit_when_orphaned(parent: int) -> None:
    """The backstop: a signal handler runs only when the main thread returns to Python, which a rank blocked in a
    collective with a dead peer may not do for the whole distributed timeout."""
    while os.getppid() == parent:
        time.sleep(1.0)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(signal_exit_code(PARENT_DEATH_SIGNAL))


def guard_training_rank() -> Optional[str]:
    """For a training rank: on the launcher's death, unwind through the normal failure path (no checkpoint) and
    be gone within ORPHAN_GRACE_S seconds. Returns why the guard is missing, if it is."""
    global _guarded_parent
    signal.signal(PARENT_DEATH_SIGNAL, _on_parent_death)
    problem = die_with_parent()
    _guarded_parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(_guarded_parent,), name="orphan-guard", daemon=True).start()
    return problem
