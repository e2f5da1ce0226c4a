"""torch's flight recorder on every process group (NCCL's on a GPU, gloo's in CPU rehearsal): each rank keeps its last
:data:`ENTRIES` collectives (which one, its sizes, its sequence number, whether it completed) in a bounded ring, and
writes them out when the hang watchdog fires (NCCL's own timeout dumps them too), beside the rank logs. torch's
analyser reads the ranks' dumps together and names the collective each rank was in:

    python -m torch.distributed.flight_recorder.fr_trace RUN/logs --prefix collective-trace_

Set through torch's environment variables before the process group is created; a value the user set wins."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

ENTRIES = 2000  # collectives each rank remembers (torch's ring buffer; a few hundred bytes each)
PREFIX = "collective-trace_"  # a rank's dump: <log_dir>/collective-trace_<rank>, as torch names its own


def environment(log_dir: str | Path) -> dict[str, str]:
    """torch's variables for the recorder: the buffer (TORCH_FR_BUFFER_SIZE, for every backend; its older name
    TORCH_NCCL_TRACE_BUFFER_SIZE makes torch 2.13 print a deprecation line per rank), NCCL's dump on its timeout,
    and where dumps go."""
    return {"TORCH_FR_BUFFER_SIZE": str(ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(Path(log_dir) / PREFIX)}


def enable(log_dir: str | Path) -> None:
    """Before init_process_group: the recorder on, unless the environment already says otherwise."""
    for name, value in environment(log_dir).items():
        os.environ.setdefault(name, value)


def dump_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"{PREFIX}{rank}"


def dump(log_dir: str | Path, rank: int) -> Optional[Path]:
    """This rank's recorded collectives written where torch's analyser reads them; None when torch has none to give.
    torch offers the dump only privately (``torch._C._distributed_c10d._dump_fr_trace``, guarded in
    tests/unit/test_upstream_patches.py)."""
    from torch._C import _distributed_c10d

    with contextlib.suppress(AttributeError, RuntimeError, OSError):
        trace = _distributed_c10d._dump_fr_trace()
        path = dump_path(log_dir, rank)
        path.write_bytes(trace)
        return path
    return None
