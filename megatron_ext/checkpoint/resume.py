"""Where a run starts: the checkpoint it resumes (or the weights it starts from), and what changed since.

A run resumes from its own ``checkpoint.save`` unless ``checkpoint.load`` names another directory (or null).
Nothing is silent: a ``checkpoint.load`` with no checkpoint is an error unless it is the run's own
``checkpoint.save`` (a first launch); every config difference to the checkpoint is listed as
``key: old → new``; a change of parameter shapes is one error naming the keys; the LR schedule follows the
current config (so ``train.train_iters`` can be raised to go on); a run never starts where it would move
its save directory's tracker back.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from megatron_ext.checkpoint import layout, manifest, save_load
from megatron_ext.checkpoint.common_state import read_common
from megatron_ext.config.schema import RecipeConfig, lr_decay_iterations, resume_dir
from megatron_ext.config.shape import ModelShape
from megatron_ext.errors import CheckpointError
from megatron_ext.storage import files

log = logging.getLogger("megatron_ext")

# Keys that differ between launches of one run by design: where it saves and logs, when it stops.
_EXPECTED_TO_CHANGE = ("checkpoint.", "logging.", "recipe.description", "train.exit_interval",
                       "train.exit_signal_handler", "data.num_workers", "data.path_to_cache", "parallel.auto",
                       "parallel.distributed_timeout_minutes", "train.hang_timeout_s")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every setting that differs, except where and how a run logs/saves."""
    old, new = _flatten(saved), _flatten(current)
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k), new.get(k)) for k in keys
            if old.get(k) != new.get(k) and not k.startswith(_EXPECTED_TO_CHANGE)]


def shape_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: old → new' for each change that gives the model other parameter shapes than the checkpoint's."""
    old, new = ModelShape.of(saved["model"]).parameter_shapes(), ModelShape.of(current["model"]).parameter_shapes()
    changes = [f"{k}: {old[k]} → {new[k]}" for k in old if old[k] != new[k]]
    vocab_old, vocab_new = saved["model"].get("vocab_size"), current["model"].get("vocab_size")
    if vocab_old is not None and vocab_new is not None and vocab_old != vocab_new:
        changes.append(f"model.vocab_size: {vocab_old} → {vocab_new}")
    return changes


def _info(message: str) -> None:
    if dist.get_rank() == 0:
        log.info(message)


def _check_config(ckpt_dir: Path, saved: dict[str, Any], cfg: RecipeConfig) -> None:
    if not saved:  # saved by a version that did not record its config
        return
    current = cfg.to_dict()
    changed = shape_changes(saved, current)
    if changed:
        raise CheckpointError(f"{ckpt_dir} was saved with other parameter shapes ({'; '.join(changed)}): set these "
                              "model.* keys back to the checkpoint's values, or start a new run without checkpoint.load")
    differences = config_differences(saved, current)
    if differences:
        _info(f"config differences to {ckpt_dir} (old → new): "
              + "; ".join(f"{key}: {old!r} → {new!r}" for key, old, new in differences))
    o = cfg.optimizer
    _info(f"LR schedule follows the current config: warmup {o.lr_warmup_iters}, {o.lr_decay_style} decay "
          f"over {lr_decay_iterations(cfg)} iterations from {o.lr} to {o.min_lr}")


@dataclasses.dataclass(frozen=True)
class StartPoint:
    """The checkpoint a run starts from, verified: a training state to resume, or weights alone (an import, or
    checkpoint.pretrained_checkpoint) — already in the model when `weights_loaded`."""

    ckpt_dir: Path
    weights_only: bool
    weights_loaded: bool = False


def newest_checkpoint(root: Optional[str | Path]) -> Optional[StartPoint]:
    """Collective: the newest intact checkpoint in `root` (a corrupt newest one set aside, see
    :func:`save_load.intact_iteration`); None when it holds none."""
    if not root:
        return None
    save_load.recover_tracker(root)
    if layout.latest_iteration(root) is None:
        return None
    ckpt_dir = layout.iteration_dir(root, save_load.intact_iteration(root))
    return StartPoint(ckpt_dir, read_common(ckpt_dir).content == layout.WEIGHTS_ONLY)


def start_point(cfg: RecipeConfig) -> Optional[StartPoint]:
    """Collective: checkpoint.load's newest intact checkpoint, else checkpoint.pretrained_checkpoint's when there is
    nothing to resume, else None (the run starts from its seed). Each is verified once here (a corrupt newest one is
    set aside, see :func:`save_load.intact_iteration`)."""
    newest = newest_checkpoint(resume_dir(cfg))
    if newest is not None:
        return newest
    pretrained = cfg.checkpoint.pretrained_checkpoint
    if pretrained:
        return StartPoint(layout.iteration_dir(pretrained, save_load.intact_iteration(pretrained)), True)
    return None


def load_weights_before_sharding(cfg: RecipeConfig, models: list) -> Optional[StartPoint]:
    """Collective, for Megatron-FSDP runs (None for the others): where the run starts, with weights it starts from
    already loaded into its unwrapped model chunks, because Megatron-FSDP shards the values the chunks hold when it
    wraps them (ZeRO-3's parameters are shards after). :func:`resume_training` takes the result."""
    if not cfg.parallel.use_megatron_fsdp:
        return None
    start = start_point(cfg)
    if start is None or not start.weights_only:
        return start
    save_load.load_weights(start.ckpt_dir, models)
    return dataclasses.replace(start, weights_loaded=True)


class Resumed(NamedTuple):
    """Where a run starts: the iteration and samples consumed, the checkpoint it read (None: nothing to read) and the
    run state saved with it (:mod:`megatron_ext.checkpoint.run_state`; None: none saved)."""

    iteration: int
    consumed_samples: int
    checkpoint: Optional[Path]
    run_state: Optional[dict] = None


def resume_training(cfg: RecipeConfig, model_chunks, optimizer, scheduler, start: Optional[StartPoint] = None
                    ) -> Resumed:
    """Collective: load what `cfg.checkpoint` asks for; returns where the run starts.
    `start`: :func:`load_weights_before_sharding`'s result, where there was one (else found here)."""
    ck = cfg.checkpoint
    load = resume_dir(cfg)
    if load:
        save_load.recover_tracker(load)
    if load and layout.latest_iteration(load) is None:
        own = ck.save and Path(load).resolve() == Path(ck.save).resolve()
        if not own:
            raise CheckpointError(f"checkpoint.load={load} holds no checkpoint ({files.at(load) / layout.TRACKER} "
                                  "not found): check the path, or leave checkpoint.load unset to start a new run")
        _info(f"no checkpoint in {load} yet: starting at iteration 0")
    start = start or start_point(cfg)
    position, run_state = (0, 0), None
    if start is not None and start.weights_only:
        if not start.weights_loaded:
            save_load.load_weights(start.ckpt_dir, [chunk.module for chunk in model_chunks])
            optimizer.reload_model_params()  # mixed precision keeps fp32 main copies of the weights
        _info(f"loaded weights of {start.ckpt_dir}; training starts at iteration 0")
    elif start is not None:
        common = read_common(start.ckpt_dir)
        problem = save_load.format_mismatch(start.ckpt_dir, common, cfg.parallel.use_megatron_fsdp)
        if problem:
            raise CheckpointError(problem)
        _check_config(start.ckpt_dir, common.config, cfg)
        position = save_load.load_training_state(start.ckpt_dir, common, model_chunks, optimizer, scheduler,
                                                 cfg.to_dict())
        run_state = common.run_state
        _info(f"resumed from {load} at iteration {position[0]} ({position[1]} samples consumed)")
    ahead = layout.latest_iteration(ck.save) if ck.save else None
    if ahead is not None and ahead > position[0]:
        raise CheckpointError(
            f"checkpoint.save={ck.save} already holds iteration {ahead}, ahead of this run's start at {position[0]}: "
            f"saving there would move its tracker back and lose that progress. Leave checkpoint.load unset (auto) "
            f"to resume it, or choose another checkpoint.save (or delete that one) to start over")
    return Resumed(*position, start.ckpt_dir if start is not None else None, run_state)


def format_refusal(cfg: RecipeConfig) -> Optional[str]:
    """Why the checkpoint to resume was written for the other data-parallel implementation (Megatron-FSDP or not),
    or None. From the newest checkpoint's common.pt alone, so the
    launcher says it before any rank starts; one it cannot read is left to the ranks, which verify it and fall back."""
    load = resume_dir(cfg)
    latest = layout.resumable_iteration(load) if load else None
    if latest is None:
        return None
    ckpt_dir = layout.iteration_dir(load, latest)
    try:
        common = read_common(ckpt_dir)
    except Exception:  # noqa: BLE001 -- a damaged checkpoint is the ranks' to report
        return None
    return save_load.format_mismatch(ckpt_dir, common, cfg.parallel.use_megatron_fsdp)


def finished_run(cfg: RecipeConfig) -> Optional[str]:
    """The one line for a launch whose checkpoint directory already holds train.train_iters (nothing to do), else
    None. From the tracker and the file sizes its manifest lists (no reads), so the launcher can say it before any
    rank starts; a damaged last checkpoint is left to the ranks, which verify it and fall back."""
    load, iters = resume_dir(cfg), cfg.train.train_iters
    latest = layout.resumable_iteration(load) if load and iters > 0 else None
    if latest is None or latest < iters or not manifest.sizes_match(layout.iteration_dir(load, latest)):
        return None
    return (f"run {cfg.recipe.name} is complete: {load} holds iteration {latest} (train.train_iters={iters}). "
            f"To train further raise train.train_iters; to start over delete {load} or choose another "
            f"checkpoint.save")
