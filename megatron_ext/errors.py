"""The errors this project raises for a person to read, each with its kind, its process exit code and, where the
raiser knows it, what to do. The lowest layer: every package may import it, it imports nothing of ours.

``resilience.failures.report_failure`` prints ``kind: message`` and exits with ``exit_code`` for any
:class:`RecipeError`; every other exception is a crash (``EXIT_FAILED``, its first line and the traceback in the
rank's log).
"""

from __future__ import annotations

import errno
from typing import Any, ClassVar

EXIT_FAILED = 1  # anything else: the traceback in the rank's log says more
EXIT_USER_ERROR = 2  # config, data, tokenizer or checkpoint: fix what the message names and run again
EXIT_DIVERGED = 3  # non-finite loss or gradients
EXIT_HUNG = 4  # the hang watchdog ended the job: requeue it, it resumes from the last checkpoint
EXIT_PEER_FAILED = 5  # this rank stopped because another one failed (that one's message says why)
EXIT_STORAGE = 6  # disk full, quota or permission denied on a path: not a node fault, so not requeued elsewhere
# a step's fault recurred when re-run on the same GPUs (train.recurring_fault=rerun_elsewhere): resume without the
# node(s) named in the run record, where the step runs again. megatron-core's EXIT_CODE_RESUME_TO_DISAMBIGUATE
EXIT_RERUN_ELSEWHERE = 16
# The errno values that make an OSError a storage error (EXIT_STORAGE)
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def signal_exit_code(signum: int) -> int:
    """The exit code of a process ended by signal `signum`, as the shell reports it: 128 + its number."""
    return 128 + int(signum)


def exit_codes_shell() -> str:
    """The exit codes above as the shell file the SLURM templates source (launch/exit_codes.sh): one table, written
    here and checked by tests/unit/test_failures.py, so a shell script never holds a copy that can drift."""
    lines = ["# shellcheck shell=bash", "# megatron_ext/errors.py's exit codes, generated from it: python -c 'from megatron_ext.errors import",
             "# exit_codes_shell; print(exit_codes_shell(), end=\"\")' > launch/exit_codes.sh",
             "# shellcheck disable=SC2034  # sourced: the scripts that source it use these"]
    lines += [f"{name}={value}" for name, value in globals().items() if name.startswith("EXIT_")]
    return "\n".join(lines) + "\n"
# recipes.launch stopped by Ctrl-C or SIGTERM exits 128 + the signal's number (130, 143) once its ranks have
# checkpointed at their next step boundary; its last line names that checkpoint.


class RecipeError(Exception):
    """An error whose message is written to be read whole: it names the key, file, rank or iteration at fault.

    `advice`: what to do, printed on its own line after the message."""

    kind: ClassVar[str] = "error"
    exit_code: ClassVar[int] = EXIT_USER_ERROR

    def __init__(self, message: str, advice: str = "") -> None:
        super().__init__(message)
        self.advice = advice


class RerunElsewhereError(RecipeError):
    """A step's fault recurred in place: the job must re-run the step on other GPUs (train.recurring_fault)."""

    kind = "fault recurred"
    exit_code = EXIT_RERUN_ELSEWHERE


class ConfigError(RecipeError, ValueError):
    """A config value is invalid; the message names the key, the value and what is valid."""

    kind = "config error"


class TokenizerError(RecipeError, ValueError):
    """A tokenizer path or type cannot be used."""

    kind = "tokenizer error"


class CheckpointError(RecipeError, RuntimeError):
    """A checkpoint cannot be written or used as asked; the message names the path and what to do."""

    kind = "checkpoint error"


class CheckpointStorageError(CheckpointError):
    """A checkpoint could not be written: disk full, quota or permission denied (not a node fault)."""

    exit_code = EXIT_STORAGE


class SaveHelperDiedError(CheckpointError):
    """A rank's checkpoint save helper process is gone (killed: the OOM killer picks the process holding a copy of the
    shards): a fault of that node, which the agent's restart repairs (the run resumes from its last complete
    checkpoint)."""

    exit_code = EXIT_FAILED


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint lacks tensors this model needs (another model shape or architecture)."""


class ConversionError(RecipeError, ValueError):
    """A Hugging Face model or checkpoint cannot be converted; the message names the file and the field."""

    kind = "conversion error"


class DivergenceError(RecipeError, RuntimeError):
    """The loss or the gradients became non-finite; raised identically on every rank."""

    kind = "divergence"
    exit_code = EXIT_DIVERGED


class DatasetError(RecipeError, ValueError):
    """An unusable dataset prefix or file; the message names the file and what to do."""

    kind = "dataset error"


class BadRecordError(DatasetError):
    """Unusable input; the message starts with `file:line:` (or `file:` for whole-file problems)."""


def require(ok: bool, key: str, value: Any, valid: str) -> None:
    """Raise the ConfigError `key=value is invalid: valid` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {valid}")
