"""The run's checkpointing in one object: where it resumes from, when it saves (checkpoint.save_interval, a stop,
the last iteration), how (in the background with checkpoint.async_save; the optimizer format policy), and
finishing what is in flight. Retention and manifests happen inside each save (:mod:`save_load`).

The run holds ``checkpoint.save``'s lock (:mod:`run_lock`) from :meth:`load` to :meth:`close`/:meth:`abort`.
The training loop calls :meth:`CheckpointManager.load` once before its first step, :meth:`due` and
:meth:`save` at the end of each step, :meth:`rewind` after a loss spike (train.spike_policy=rewind), and
:meth:`close` (or :meth:`abort` when failing) at the end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.checkpoint import fsdp_dtensor, save_load
from megatron_ext.checkpoint.async_save import AsyncCheckpointSaver
from megatron_ext.checkpoint.common_state import read_common
from megatron_ext.checkpoint.resume import Resumed, StartPoint, newest_checkpoint, resume_training
from megatron_ext.checkpoint.run_lock import RunLock
from megatron_ext.checkpoint.run_state import RunState
from megatron_ext.config.schema import RecipeConfig
from megatron_ext.errors import CheckpointError, CheckpointStorageError


class CheckpointManager:
    """Checkpoints of one run on this rank (every method is collective over the job's ranks)."""

    @staticmethod
    def start_save_helper(cfg: RecipeConfig, initializer: Optional[Callable[[], object]] = None) -> bool:
        """Before the process groups exist, for a run that saves: start the save helper process, which runs
        `initializer` first (:func:`save_load.start_save_helpers`); whether it was started."""
        if cfg.checkpoint.save is None:
            return False
        save_load.start_save_helpers(initializer)
        return True

    def __init__(self, cfg: RecipeConfig, model_chunks: list, optimizer: MegatronOptimizer,
                 scheduler: OptimizerParamScheduler, on_gpu: bool, before_commit: Optional[Callable[[], None]] = None,
                 run_state: Optional[RunState] = None):
        """`before_commit`: called on every rank before a checkpoint is made complete; it may raise to stop it.
        `run_state`: the loop's registered components, saved with every training checkpoint."""
        self.cfg = cfg
        self.run_state = run_state or RunState()
        self.before_commit = before_commit
        self.model, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        ck = cfg.checkpoint
        self.enabled = ck.save is not None
        use_async = ck.async_save if ck.async_save is not None else on_gpu
        self.saver = AsyncCheckpointSaver() if self.enabled and use_async else None
        self.lock: RunLock | None = None
        self.last_save = time.monotonic()  # the clock checkpoint.save_interval_minutes runs on
        self.saved_iteration: Optional[int] = None  # the last checkpoint this run wrote

    def load(self, start: Optional[StartPoint] = None) -> Resumed:
        """Take the save directory's run lock, then resume (checkpoint.load) or start from weights
        (checkpoint.pretrained_checkpoint) — from `start` when the run found it before wrapping its model
        (:func:`resume.load_weights_before_sharding`); returns where the run continues from."""
        self._lock_save_directory()
        return resume_training(self.cfg, self.model, self.optimizer, self.scheduler, start)

    def _lock_save_directory(self) -> None:
        """Rank 0 takes checkpoint.save's run lock; every rank raises the same error when another run holds it."""
        if not self.enabled:
            return
        refusal = None
        if dist.get_rank() == 0:
            lock = RunLock(self.cfg.checkpoint.save)
            try:
                lock.acquire()
                self.lock = lock
            except CheckpointError as e:  # a storage error (exit 6: requeued elsewhere) stays one on every rank
                refusal = (isinstance(e, CheckpointStorageError), str(e))
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        if shared[0]:
            storage, message = shared[0]
            raise (CheckpointStorageError if storage else CheckpointError)(message)

    def rewind(self) -> Optional[Resumed]:
        """Collective: back to the newest intact training checkpoint in checkpoint.save (saves in flight finished
        first) — model, optimizer, LR schedule and RNG; None when there is none yet to go back to."""
        if self.saver:
            self.saver.finalize(blocking=True)
        newest = newest_checkpoint(self.cfg.checkpoint.save) if self.enabled else None
        if newest is None or newest.weights_only:
            return None
        common = read_common(newest.ckpt_dir)
        iteration, consumed = save_load.load_training_state(newest.ckpt_dir, common, self.model, self.optimizer,
                                                            self.scheduler, self.cfg.to_dict())
        return Resumed(iteration, consumed, newest.ckpt_dir, common.run_state)

    def due(self, iteration: int, stopping: bool, clock_due: bool = False) -> bool:
        """This run saves after `iteration` (see :func:`save_due`); `clock_due`: the ranks agreed that
        checkpoint.save_interval_minutes have passed (:meth:`save_due_by_clock` on rank 0)."""
        return self.enabled and (clock_due or save_due(self.cfg, iteration, stopping))

    def save_due_by_clock(self) -> bool:
        """checkpoint.save_interval_minutes have passed since the last save (or the start) on this rank's clock."""
        minutes = self.cfg.checkpoint.save_interval_minutes
        return self.enabled and minutes is not None and time.monotonic() - self.last_save >= 60 * minutes

    def finish_completed_writes(self) -> None:
        """Finalise background saves whose writes every rank has finished (manifest, tracker, retention)."""
        if self.saver:
            self.saver.finalize(blocking=False)

    def save(self, iteration: int, consumed_samples: int) -> tuple[Path, float]:
        """Write the checkpoint of `iteration` (in the background with async_save, once the previous one is
        complete); returns its path and how long training stalled for it."""
        ck = self.cfg.checkpoint
        start = time.perf_counter()
        if self.saver:
            self.saver.finalize(blocking=True)
        self._stop_if_lock_lost()
        path = save_load.save_checkpoint(
            ck.save, iteration, self.model, self.optimizer, self.scheduler, consumed_samples, self.cfg.to_dict(),
            keep_last=ck.keep_last, keep_every=ck.keep_every, saver=self.saver,
            optimizer_format=optimizer_format_for(self.cfg, iteration), before_commit=self._before_commit,
            run_state=self.run_state.state_dict())
        self.last_save, self.saved_iteration = time.monotonic(), iteration
        return path, time.perf_counter() - start

    def _before_commit(self) -> None:
        """Every rank, before a checkpoint is made complete (manifest, tracker, retention)."""
        self._stop_if_lock_lost()
        if self.before_commit is not None:
            self.before_commit()

    def _stop_if_lock_lost(self) -> None:
        """Collective: every rank raises the same one line when another run took over rank 0's run lock, so
        nothing is written, committed or deleted in a directory this run no longer owns."""
        lost = [self.lock.lost() if self.lock is not None else None]
        dist.broadcast_object_list(lost, src=0)
        if lost[0]:
            raise CheckpointError(lost[0])

    def close(self) -> None:
        """Wait until every save in flight is complete: the last checkpoint exists before the run reports it."""
        if self.saver:
            self.saver.close()
        self._unlock()

    def abort(self) -> None:
        """The run is failing: stop the background writer without finishing anything (the tracker stays)."""
        if self.saver:
            self.saver.abort()
        self._unlock()

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def asynchronous(self) -> bool:
        return self.saver is not None


def save_due(cfg: RecipeConfig, iteration: int, stopping: bool) -> bool:
    """A checkpoint is written after `iteration`: every checkpoint.save_interval, when the run stops early, and at
    train.train_iters (also a 0-step run, which saves its initial weights)."""
    interval = cfg.checkpoint.save_interval
    return bool(interval and iteration % interval == 0) or stopping or iteration == cfg.train.train_iters


def optimizer_format_for(cfg: RecipeConfig, iteration: int) -> str:
    """checkpoint.optimizer_format for the save at `iteration`: `auto` writes the lean dp_reshardable format along
    the way and the fully reshardable one for the finished run, the one handed on; Megatron-FSDP, fsdp_dtensor."""
    fmt = cfg.checkpoint.optimizer_format
    if cfg.parallel.use_megatron_fsdp:
        return fsdp_dtensor.FORMAT
    if not cfg.parallel.use_distributed_optimizer:
        return "fully_reshardable"  # unused by the plain optimizer; recorded so no DP-only check applies
    if fmt != "auto":
        return fmt
    if iteration < cfg.train.train_iters:
        return "dp_reshardable"
    # megatron-core builds Muon's distributed optimizer without the gloo groups the memory-efficient gather uses
    return "fully_reshardable" if cfg.optimizer.name == "muon" else "fully_reshardable_mem_efficient"
