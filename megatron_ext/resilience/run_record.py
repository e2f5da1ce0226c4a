"""The end of a run as data, in ``<logging.log_dir>/run-result/``: what the SLURM templates (and any script around a
run) read instead of console text, which several nodes interleave into one log.

Two kinds of writer, each its own JSON file, written whole (temporary file, then rename):

- rank 0, when training ends: ``training.json`` — how it ended (``finished``, ``exit signal``, ``exit interval``,
  ``rerun elsewhere``), at which iteration, where the run's wall-clock went since its first start (the goodput
  ledger's seconds), and for ``rerun elsewhere`` the nodes a requeue must leave out;
- each node's launcher (``recipes.launch``), when its ranks have ended: ``node-<name>.json`` — its exit code and, when
  one of its ranks failed by itself, that rank (a node whose ranks only stopped because a peer failed says
  ``followed``; one whose agent left the job after a fault recurred on its GPU, ``left``; a hot spare the job ended
  without, ``not needed``).

``python -m megatron_ext.resilience.run_record LOG_DIR`` prints the job's verdict as shell assignments
(``ENDED=... ITERATION=... FAILED_NODES=... SUSPECT_NODES=...``). Standard library only: the SLURM batch script runs it with the host's
``python3`` when the ranks run in a container.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

RECORD_DIR = "run-result"
TRAINING_RECORD = "training.json"
VERSION = 1

TrainingEnd = Literal["finished", "exit signal", "exit interval", "rerun elsewhere"]
NodeOutcome = Literal["finished", "failed", "followed", "signalled", "left", "not needed"]


@dataclass(frozen=True)
class TrainingRecord:
    ended: TrainingEnd
    iteration: int
    # where the run's wall-clock went since its first start, in seconds per bucket (metrics.goodput_ledger)
    goodput_seconds: Optional[dict[str, float]] = None
    # "rerun elsewhere": the nodes whose GPUs met a fault that recurred in place (resilience.reruns)
    suspect_nodes: Optional[list[str]] = None
    version: int = VERSION


@dataclass(frozen=True)
class NodeRecord:
    node: str
    outcome: NodeOutcome
    exit_code: int
    failed_rank: Optional[int] = None  # the rank on this node that failed first (outcome "failed")
    version: int = VERSION


def node_name() -> str:
    """This node's name as SLURM knows it (what ``--exclude`` takes), else its hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def record_dir(log_dir: str | Path) -> Path:
    return Path(log_dir) / RECORD_DIR


def node_record_path(log_dir: str | Path, node: str) -> Path:
    return record_dir(log_dir) / f"node-{node}.json"


def _write(path: Path, record: TrainingRecord | NodeRecord) -> None:
    """Whole or not at all; a record that cannot be written is a warning (the run itself has ended as it did)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f)
        os.replace(tmp, path)
    except OSError as e:
        print(f"warning: could not write the run record {path} ({e}); a SLURM template decides from the exit code "
              "alone", file=sys.stderr, flush=True)


def write_training_end(log_dir: str | Path, record: TrainingRecord) -> None:
    _write(training_record_path(log_dir), record)


def write_node_end(log_dir: str | Path, record: NodeRecord) -> None:
    _write(node_record_path(log_dir, record.node), record)


def forget(path: Path) -> None:
    """A record left by an earlier launch of the same run is not this one's."""
    try:
        path.unlink(missing_ok=True)
    except OSError:  # an unwritable log directory: the write at the end says so
        pass


def training_record_path(log_dir: str | Path) -> Path:
    return record_dir(log_dir) / TRAINING_RECORD


def read_training_end(log_dir: str | Path) -> Optional[TrainingRecord]:
    path = training_record_path(log_dir)
    try:
        return TrainingRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # absent, or not this version's shape: no verdict from it
        return None


def read_node_ends(log_dir: str | Path) -> list[NodeRecord]:
    records = []
    for path in sorted(record_dir(log_dir).glob("node-*.json")):
        try:
            records.append(NodeRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return records


def verdict(log_dir: str | Path) -> dict[str, str]:
    """ENDED (a TrainingEnd, or empty when training did not end), ITERATION, FAILED_NODES (comma-separated: the
    nodes where a rank failed by itself, and those that left the job after a fault recurred on their GPU, which a
    requeue leaves out too), SUSPECT_NODES (comma-separated: ``rerun elsewhere``'s)."""
    training = read_training_end(log_dir)
    failed = [r.node for r in read_node_ends(log_dir) if r.outcome in ("failed", "left")]
    return {"ENDED": training.ended if training else "", "ITERATION": str(training.iteration) if training else "",
            "FAILED_NODES": ",".join(failed), "SUSPECT_NODES": ",".join(training.suspect_nodes or []) if training else ""}


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m megatron_ext.resilience.run_record LOG_DIR", file=sys.stderr)
        return 2
    print(" ".join(f"{key}={shlex.quote(value)}" for key, value in verdict(args[0]).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
