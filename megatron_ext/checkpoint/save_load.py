"""Save/resume through megatron-core dist_checkpointing (torch_dist): reshardable across TP/PP/VPP/DP.

Layout: ``<save>/iter_XXXXXXX/`` holds model chunks, optimizer, LR scheduler, RNG states,
consumed samples, the run config and a manifest of its files (:mod:`megatron_ext.checkpoint.manifest`);
``<save>/latest_checkpointed_iteration.txt`` is replaced atomically only after every rank finished
writing and the manifest exists, so a crash mid-save never points at a half-written checkpoint. A save
that fails on any rank removes its directory and leaves the tracker and older checkpoints as they were;
a tracker never moves back to an older iteration, except past a checkpoint found corrupt on load.

Checkpoints load under either layer spec and Adam implementation (local + torch AdamW, or
TransformerEngine + TE FusedAdam): see :mod:`megatron_ext.checkpoint.compat`.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.checkpoint import compat, fsdp_dtensor, manifest, model_class, save_helper
from megatron_ext.checkpoint.async_save import ASYNC_STRATEGY, AsyncCheckpointSaver, agreed_failure, writer_modules
from megatron_ext.checkpoint.common_state import CommonState
from megatron_ext.checkpoint.layout import (
    TRACKER,
    TRAINING_STATE,
    WEIGHTS_ONLY,
    complete_iterations,
    iteration_dir,
    latest_iteration,
    set_aside,
    write_tracker,
)
from megatron_ext.checkpoint.optimizer_format import (
    DP_RESHARDABLE,
    buffer_layouts,
    load_problem,
    master_weights_problem,
    optimizer_metadata,
    padding_within_buckets,
    state_in_buffer_layout,
)
from megatron_ext.checkpoint.retention import apply_retention
from megatron_ext.checkpoint.rng import local_rng_state, rng_state, set_rng_state
from megatron_ext.errors import STORAGE_ERRNOS, CheckpointError, CheckpointStorageError
from megatron_ext.storage import files

log = logging.getLogger(__name__)


class _RankZeroWrite:
    """megatron-core's save ends with rank 0 writing ``metadata.json`` and then a barrier on every rank: if that write
    failed (disk full) rank 0 would skip the barrier and wait in the save's failure agreement while the others wait
    in the barrier. The write's error is kept instead and raised after the barrier (:meth:`raise_kept`), inside the
    phase whose failure every rank agrees on."""

    def __init__(self):
        from megatron.core.dist_checkpointing import serialization

        self.kept: list[BaseException] = []
        real = serialization.save_config

        def save_config(*args: Any, **kwargs: Any) -> None:
            try:
                real(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- any failure of the write: raised after the barrier
                self.kept.append(e)

        serialization.save_config = save_config

    def raise_kept(self) -> None:
        if self.kept:
            error, self.kept[:] = self.kept[0], []
            raise error


_metadata_write = _RankZeroWrite()


def _bare(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The models inside the DDP wrappers: their state's keys must not get "module."."""
    return [chunk.module for chunk in model_chunks]


def _model_state(models: list[torch.nn.Module]) -> dict[str, Any]:
    """The sharded state of unwrapped models (one per virtual pipeline stage)."""
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": model.sharded_state_dict() for i, model in enumerate(models)}


def _sharded_state(model_chunks, optimizer: Optional[MegatronOptimizer], scheduler, is_loading: bool,
                   with_rng: bool, optimizer_format: str) -> dict[str, Any]:
    state = _model_state(_bare(model_chunks))
    if optimizer is not None:
        compat.fill_empty_adam_state(optimizer)
        with state_in_buffer_layout(optimizer):
            state["optimizer"] = padding_within_buckets(optimizer.sharded_state_dict(
                {k: v for k, v in state.items() if k.startswith("model")}, is_loading=is_loading,
                metadata=optimizer_metadata(optimizer_format),
            ))
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = rng_state()
    return state


def _from_every_rank(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def format_mismatch(ckpt_dir: Path, common: CommonState, use_megatron_fsdp: bool) -> Optional[str]:
    """Why `ckpt_dir` cannot be resumed (or, holding weights only, started from) in a run with(out) Megatron-FSDP, or
    None when it can."""
    if common.content == WEIGHTS_ONLY:
        return None  # weights load into either (a Megatron-FSDP run's before it shards them)
    saved_fsdp = common.optimizer_format == fsdp_dtensor.FORMAT
    if saved_fsdp == use_megatron_fsdp:
        return None
    saved, other = (("a Megatron-FSDP run (fsdp_dtensor format)", "true") if saved_fsdp
                    else ("a run without Megatron-FSDP (torch_dist format)", "false"))
    return (f"{ckpt_dir} was saved by {saved}, whose optimizer state does not load into this run's "
            f"{'distributed optimizer' if saved_fsdp else 'Megatron-FSDP'}: resume it with "
            f"parallel.use_megatron_fsdp={other} (any DP size), or carry its weights over without the optimizer "
            "state: python -m recipes.convert export-hf, then import-hf, then checkpoint.pretrained_checkpoint")


def _save_strategy() -> FullyParallelSaveStrategyWrapper:
    """torch_dist, with what DP replicas hold in common (the model weights; all optimizer state but
    dp_reshardable's) split for writing over the DP×CP ranks instead of all written by DP rank 0."""
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def start_save_helpers(initializer: Optional[Callable[[], object]] = None) -> None:
    """Start the rank's checkpoint save helper (:mod:`save_helper`) now, running `initializer` first, as the results
    queue of both writers; call it before process groups exist.

    The torch_dist save starts its Manager on its first call (megatron-core 0.19.2, strategies/filesystem_async.py,
    ``get_write_results_queue``) and keeps it for the life of the rank; started then, a pre-emption signal to the
    rank's process tree would kill it and fail the checkpoint the signal asked for.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writers = [sys.modules[writer_modules()["FileSystemWriterAsync"].__module__], filesystem_async]
    if all(writer._results_queue is not None for writer in writers):
        return
    # what get_write_results_queue would create: for the async writer (NVRx's), and for megatron-core's own, through
    # which its synchronous save writes
    results = save_helper.start(initializer)
    for writer in writers:
        writer._results_queue = results


def _on_every_rank(step: Callable[[], None], target: Path, what: str) -> None:
    """Run one collective phase of a save; if it failed on any rank, remove the partial `target` and raise on
    every rank one CheckpointError naming each failed rank's cause (the ranks agree before going on)."""
    try:
        step()
        error = None
    # ENOSPC, permission, a broken file system; torch's CheckpointException is a BaseException
    except (Exception, CheckpointException) as e:
        error = e
    try:
        causes = agreed_failure(error)
    except BaseException as agreement:  # the collective timed out: other ranks still wait inside megatron-core's save
        if error is None:
            raise
        raise CheckpointError(
            f"saving {target} failed on this rank while {what} ({type(error).__name__}: {error}), and the ranks that "
            f"did not fail never joined the agreement on it (they waited inside megatron-core's save until the "
            f"collective timeout, parallel.distributed_timeout_minutes); the tracker still names the previous "
            f"checkpoint") from agreement
    if causes is None:
        return
    if dist.get_rank() == 0:
        files.remove_tree(target)
    dist.barrier()
    save_helper.raise_if_a_helper_died(f"while {target} was written", f"removed the partial {target.name}")
    previous = latest_iteration(target.parent)
    storage = any(int(n) in STORAGE_ERRNOS for n in re.findall(r"\[Errno (\d+)\]", causes))
    raise (CheckpointStorageError if storage else CheckpointError)(
        f"saving {target} failed while {what} ({causes}). Removed the partial {target.name}; the tracker still names "
        + (f"iteration {previous}" if previous is not None else "no checkpoint")
        + " and older checkpoints are untouched. Free space or fix the path, then resume with "
          f"checkpoint.load={target.parent}")


def _new_iteration_dir(root: Path, iteration: int) -> Path:
    """Collective: an empty iter_XXXXXXX under `root` (one left over from a crashed save of the same iteration is
    removed first)."""
    target = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        files.remove_tree(target)
        target.mkdir(parents=True)
    dist.barrier()
    return target


def _commit(root: Path, iteration: int, before_commit: Optional[Callable[[], None]] = None) -> None:
    """Collective, once every rank's shards are written: the manifest, then the tracker — the commit point. Any
    rank's failure removes the iteration's directory on every rank (:func:`_on_every_rank`)."""
    target = iteration_dir(root, iteration)
    _on_every_rank(_metadata_write.raise_kept, target, "writing metadata.json")
    if before_commit is not None:
        before_commit()
    _on_every_rank(lambda: manifest.write_manifest(target), target, "writing the manifest")
    _on_every_rank(lambda: write_tracker(root, iteration) if dist.get_rank() == 0 else None, target,
                   "moving the tracker")


def save_weights_only(root: str | Path, model_state: dict[str, Any], run_config: dict[str, Any],
                      strategy: Optional[TorchDistSaveShardedStrategy] = None) -> Path:
    """Collective: a bare model's weights (its sharded state dict; written by `strategy`, by default the training's) as
    a complete iteration-0 checkpoint of content weights_only, written, verified and committed like a training run's
    (``recipes.convert import-hf``)."""
    root = files.at(root)
    target = _new_iteration_dir(root, 0)
    state = {"model": model_state, **CommonState(0, 0, run_config, WEIGHTS_ONLY).saved()}
    _on_every_rank(lambda: dist_checkpointing.save(state, str(target), strategy or _save_strategy()), target,
                   "writing the shards")
    _commit(root, 0)
    return target


def save_checkpoint(root: str | Path, iteration: int, model_chunks, optimizer: MegatronOptimizer,
                    scheduler: OptimizerParamScheduler, consumed_samples: int, run_config: dict[str, Any],
                    keep_last: Optional[int] = None, keep_every: Optional[int] = None,
                    saver: Optional[AsyncCheckpointSaver] = None,
                    *, optimizer_format: str, before_commit: Optional[Callable[[], None]] = None,
                    run_state: Optional[dict[str, Any]] = None) -> Path:
    """Collective: every rank writes its shards (and `run_state`, :mod:`run_state`'s) into iter_XXXXXXX, the manifest is written, then rank 0
    moves the tracker and applies retention (:mod:`checkpoint_retention`). With `saver` the shards are
    written in the background and the rest happens when the saver finalizes it. `before_commit` may raise to
    leave the shards without a manifest (a resume ignores them): a rank whose launcher died must not commit."""
    root = files.at(root)
    save_helper.raise_if_a_helper_died(f"before the checkpoint of iteration {iteration} was written",
                                       "nothing was saved")
    ahead = latest_iteration(root)
    if ahead is not None and ahead > iteration:
        raise CheckpointError(f"{root} already holds iteration {ahead}, ahead of this save at {iteration}: "
                              "refusing to move its tracker back")
    target = _new_iteration_dir(root, iteration)
    if optimizer_format == fsdp_dtensor.FORMAT:
        common = CommonState(iteration, consumed_samples, run_config, TRAINING_STATE, optimizer_format,
                             scheduler=scheduler.state_dict(), rng=_from_every_rank(local_rng_state()),
                             run_state=run_state)

        def write(asynchronous: bool) -> Optional[Any]:
            return fsdp_dtensor.save(model_chunks, optimizer, target, common, asynchronous)
    else:
        state = _sharded_state(model_chunks, optimizer, scheduler, is_loading=False, with_rng=True,
                               optimizer_format=optimizer_format)
        state.update(CommonState(iteration, consumed_samples, run_config, TRAINING_STATE, optimizer_format,
                                 buffer_layouts=buffer_layouts(model_chunks) if optimizer_format == DP_RESHARDABLE
                                 else None, run_state=run_state).saved())

        def write(asynchronous: bool) -> Optional[Any]:
            return dist_checkpointing.save(state, str(target), _save_strategy(), async_sharded_save=asynchronous,
                                           async_strategy=ASYNC_STRATEGY)

    def finish() -> None:
        _commit(root, iteration, before_commit)
        if dist.get_rank() == 0:
            apply_retention(root, iteration, keep_last, keep_every)
        dist.barrier()

    if saver is None:
        _on_every_rank(lambda: write(False), target, "writing the shards")
        finish()
        return target
    requests = []
    _on_every_rank(lambda: requests.append(write(True)), target, "starting the asynchronous write")
    saver.schedule(requests[0], target, finish)
    return target


def recover_tracker(root: str | Path) -> None:
    """Collective: a `root` whose tracker is missing or unreadable, beside complete checkpoints (each with its
    manifest), gets it back pointing at the newest of them, with a warning — a run never starts from iteration 0
    over them and overwrites them. :func:`intact_iteration` then verifies that checkpoint's files. Without complete
    checkpoints nothing changes (an unreadable tracker stays the one-line error it is)."""
    root = files.at(root)
    if not root.is_dir():
        return
    try:
        if latest_iteration(root) is not None:
            return
        problem = f"{root / TRACKER} is missing"
    except CheckpointError as e:
        problem = str(e).split(";")[0]
    complete = complete_iterations(root)
    if not complete:
        return
    if dist.get_rank() == 0:
        log.warning(f"CHECKPOINT TRACKER LOST: {problem}, beside the complete checkpoints of iterations "
                    f"{', '.join(map(str, complete))}: resuming from the newest, iteration {complete[-1]} (its "
                    "manifest is checked next); the tracker points at it again")
        write_tracker(root, complete[-1])
    dist.barrier()


def intact_iteration(root: str | Path) -> int:
    """Collective: the newest checkpoint in `root` whose files match their manifest.

    A corrupt or incomplete one is renamed aside (``iter_XXXXXXX.corrupt``) with a warning naming the file
    and the reason, and the next older complete one is used (the tracker follows it: the checkpoint it
    named is gone); with none left, one CheckpointError.
    """
    root = files.at(root)
    iteration = latest_iteration(root)
    if iteration is None:
        raise CheckpointError(f"{root / TRACKER} not found: {root} holds no complete checkpoint")
    while True:
        ckpt = iteration_dir(root, iteration)
        problem = manifest.verify(ckpt) if ckpt.is_dir() else f"{ckpt} is missing"
        if problem is None:
            return iteration
        older = [i for i in complete_iterations(root) if i < iteration]
        if dist.get_rank() == 0:
            renamed = f"Renamed it to {set_aside(ckpt).name}; " if ckpt.is_dir() else ""
            log.warning(f"CHECKPOINT NOT USABLE: {problem}. {renamed}" + (
                f"resuming from the previous complete checkpoint, iteration {older[-1]}." if older
                else "no older complete checkpoint."))
            if older:
                write_tracker(root, older[-1])
        dist.barrier()
        if not older:
            raise CheckpointError(f"{root} holds no intact checkpoint: {problem}")
        iteration = older[-1]


def load_training_state(ckpt_dir: Path, common: CommonState, model_chunks, optimizer: MegatronOptimizer,
                        scheduler: OptimizerParamScheduler, current_config: dict[str, Any]) -> tuple[int, int]:
    """Model, optimizer, LR schedule position and RNG of a training checkpoint; returns (iteration, consumed_samples)."""
    # RNG states are saved per (PP, TP) rank; under another TP/PP layout they have no counterpart
    # and stay freshly seeded (they only drive dropout, which the Llama recipes do not use).
    saved = common.config.get("parallel", {})
    problem = load_problem(ckpt_dir, common, model_chunks, current_config)
    if problem:
        raise CheckpointError(problem)
    if common.optimizer_format == fsdp_dtensor.FORMAT:
        return _load_fsdp_training_state(ckpt_dir, common, model_chunks, optimizer, scheduler)
    same_layout = (saved.get("tensor_model_parallel_size"), saved.get("pipeline_model_parallel_size")) == (
        parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size())
    if not same_layout and dist.get_rank() == 0:
        log.info(f"resharding {ckpt_dir} from TP{saved.get('tensor_model_parallel_size')}×"
                 f"PP{saved.get('pipeline_model_parallel_size')}: RNG states are not restored")
    state = _sharded_state(model_chunks, optimizer, scheduler, is_loading=True, with_rng=same_layout,
                           optimizer_format=common.optimizer_format)
    model_class.read_gpt_checkpoint_into_hybrid(state, ckpt_dir, _bare(model_chunks))
    loaded = compat.load_sharded(state, ckpt_dir)
    compat.load_model_chunks(_bare(model_chunks), loaded)
    problem = master_weights_problem(ckpt_dir, optimizer, loaded["optimizer"])
    if problem:
        raise CheckpointError(problem)
    # no_grad: in fp32 the distributed optimizer's main params are views of the model's leaf params, which
    # dp_reshardable's load copies into in place (an autograd error otherwise).
    with torch.no_grad():
        compat.load_optimizer(optimizer, loaded["optimizer"])
    _load_scheduler(scheduler, loaded["opt_param_scheduler"])
    if same_layout:
        set_rng_state(loaded["rng_state"])
    return int(loaded["iteration"]), int(loaded["consumed_samples"])


def _load_scheduler(scheduler: OptimizerParamScheduler, state: dict[str, Any]) -> None:
    """The LR schedule's position as saved, also into a schedule that has run (a spike rewind): megatron-core's
    load_state_dict adds the saved step count to the schedule's own."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def _load_fsdp_training_state(ckpt_dir: Path, common: CommonState, model_chunks, optimizer: MegatronOptimizer,
                               scheduler: OptimizerParamScheduler) -> tuple[int, int]:
    fsdp_dtensor.load(ckpt_dir, model_chunks, optimizer)
    _load_scheduler(scheduler, common.scheduler)
    saved_rng = common.rng
    if len(saved_rng) == dist.get_world_size():  # same world: rank r continues rank r's streams
        set_rng_state([saved_rng[dist.get_rank()]])
    elif dist.get_rank() == 0:
        log.info(f"{ckpt_dir} was saved by {len(saved_rng)} ranks: RNG states are not restored")
    return common.iteration, common.consumed_samples


def load_weights(ckpt_dir: Path, models: list[torch.nn.Module]) -> None:
    """Collective: the model weights alone of `ckpt_dir` (saved in any layout, without Megatron-FSDP) into unwrapped
    model chunks, each rank its own tensor- and pipeline-parallel part."""
    state = _model_state(models)
    model_class.read_gpt_checkpoint_into_hybrid(state, ckpt_dir, models)
    compat.load_model_chunks(models, compat.load_sharded(state, ckpt_dir))

