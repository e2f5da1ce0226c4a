"""Every key this project puts in a torch.distributed key-value store, named in one place.

Keys live under ``megatron_ext/``, each world's in a namespace of its own so that a restarted world never reads an
old world's keys: the process group's (:func:`process_group_namespace`, by torchrun's restart count) and the job
store's (:func:`job_namespace`: failure reports, heartbeats; by the job's run id and restart, or the world the
launcher's agent names). The launcher agents' own keys (:func:`rerun_elsewhere_key`) sit in their rendezvous round's
store, by the iteration they concern.
"""

from __future__ import annotations

import hashlib
from typing import Literal

NAMESPACE = "megatron_ext"


def process_group_namespace(restart: str) -> str:
    """The process group's keys after torchrun's agent restarted the workers `restart` times."""
    return f"{NAMESPACE}/process_group/{restart}"


def job_namespace(world: str) -> str:
    """The job store's keys of one world (``<run id>/<restart count>``, or the world an agent named)."""
    return f"{NAMESPACE}/{world}"


def heartbeat_key(rank: int) -> str:
    """A rank's heartbeat count and iteration (the hang watchdog's)."""
    return f"hb/{rank}"


def process_key(rank: int) -> str:
    """A rank's host and process id (the hang watchdog's, to name a stopped rank)."""
    return f"proc/{rank}"


def failure_key(report: str) -> str:
    """One failure report's, so that the first rank to report it alone says it."""
    return "failure/" + hashlib.sha1(report.encode()).hexdigest()[:16]


def rerun_elsewhere_key(iteration: int, what: Literal["host", "waiting"]) -> str:
    """The agents' agreement after a fault recurred at `iteration`: which node hosts the rendezvous store, how many
    agents wait to join."""
    return f"{NAMESPACE}/rerun_elsewhere/{iteration}/{what}"
