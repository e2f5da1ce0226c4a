"""The key-value store every rank of a job already shares (torchrun's agent hosts it): short-timeout clients for
failure reports and heartbeats, namespaced per launch so a restarted job never reads an old attempt's keys."""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch.distributed as dist


def job_store(timeout_s: float = 10.0) -> Optional[dist.Store]:
    """A new client of the job's store, or None where there is none (no MASTER_ADDR/MASTER_PORT yet). Its own
    connection: a thread may use it while the main thread is blocked in a collective."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError):  # the store's host is gone (the launcher died): nothing left to coordinate
        return None
    launch = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"megatron_ext/{launch}/", store)
