"""The key-value store every rank of a job shares, held by a launcher's agent rather than by a rank (a rank that
stops or exits must not take it with it): short-timeout clients for failure reports and heartbeats, namespaced per
world so a restarted job never reads an old world's keys.

Where it is: torchrun's agent shares its store with the ranks (``MASTER_ADDR``/``MASTER_PORT``) when it may; where
``recipes.launch`` keeps the rendezvous store to the agents (every multi-node c10d launch), the ranks' own store is
hosted by rank 0, so the agent names its rendezvous store and the world's round in ``RECIPES_JOB_STORE``
(megatron_ext/resilience/agent.py) and the ranks use that.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Optional

from megatron_ext.distributed.store_keys import job_namespace

if TYPE_CHECKING:
    import torch.distributed as dist

# "host:port/world": the rendezvous host agent's store and a name for the world the ranks belong to
JOB_STORE = "RECIPES_JOB_STORE"


def job_store(timeout_s: float = 10.0) -> Optional[dist.Store]:
    """A new client of the job's store, or None where there is none (no store named yet, or its host is gone). Its
    own connection: a thread may use it while the main thread is blocked in a collective."""
    import torch.distributed as dist

    if os.environ.get(JOB_STORE):
        address, world = os.environ[JOB_STORE].split("/", 1)
        host, port = address.rsplit(":", 1)
    else:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        world = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if not host or not port:
        return None
    try:
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError):  # the store's host is gone (the launcher died): nothing left to coordinate
        return None
    return dist.PrefixStore(job_namespace(world), store)
