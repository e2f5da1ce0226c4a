"""What a checkpoint of this recipe holds beside its shards, typed: :class:`CommonState`, written by every save (a
training run's, ``recipes.convert import-hf``'s weights) and read by every reader through :func:`read_common`, in
any of the checkpoint formats and versions this project has written.

The stored keys keep their first names (``iteration``, ``consumed_samples``, ``config``, ``content``,
``optimizer_format``, ...) so that checkpoints written before this class load unchanged; ``common_state_version``
says which shape a checkpoint has (absent: written before it was recorded, version 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from megatron_ext.checkpoint.layout import COMMON_STATE, DIST_METADATA, TRAINING_STATE, WEIGHTS_ONLY
from megatron_ext.errors import CheckpointError

VERSION = 1
Content = Literal["training_state", "weights_only"]
# A training checkpoint written before the optimizer format was recorded holds megatron-core's fully reshardable one
FORMAT_OF_OLDER_CHECKPOINTS = "fully_reshardable"


@dataclass(frozen=True)
class CommonState:
    iteration: int
    consumed_samples: int
    config: dict[str, Any]  # the run's whole RecipeConfig as a dict
    content: Content = TRAINING_STATE  # weights_only: model weights alone, started from at iteration 0
    # a training checkpoint's optimizer state format (config.schema.OptimizerFormat, or fsdp_dtensor's); None for
    # weights only
    optimizer_format: Optional[str] = None
    buffer_layouts: Optional[dict[str, Any]] = None  # dp_reshardable: each rank's parameter buffers, to check a load
    # the fsdp_dtensor format keeps the LR schedule and every rank's RNG here (torch_dist keeps them in its shards)
    scheduler: Optional[dict[str, Any]] = None
    rng: Optional[list[Any]] = None
    # the loop's registered components' state (:mod:`megatron_ext.checkpoint.run_state`), by name
    run_state: Optional[dict[str, Any]] = None
    version: int = VERSION

    def saved(self) -> dict[str, Any]:
        """The entries as stored: what is None is left out."""
        stored = {"iteration": self.iteration, "consumed_samples": self.consumed_samples, "config": self.config,
                  "content": self.content, "optimizer_format": self.optimizer_format,
                  "buffer_layouts": self.buffer_layouts, "opt_param_scheduler": self.scheduler,
                  "rng_state": self.rng, "run_state": self.run_state, "common_state_version": self.version}
        return {key: value for key, value in stored.items() if value is not None}

    @classmethod
    def from_saved(cls, ckpt_dir: Path, stored: dict[str, Any]) -> CommonState:
        """The common state of `ckpt_dir` from its stored entries, any version; CheckpointError naming what is
        missing or malformed."""
        if not isinstance(stored, dict):
            raise CheckpointError(f"{ckpt_dir}: its common state is a {type(stored).__name__}, not a mapping: not a "
                                  "checkpoint of this recipe")
        for key, kind in (("iteration", int), ("config", dict)):
            if not isinstance(stored.get(key), kind):
                raise CheckpointError(f"{ckpt_dir}: its common state has no {kind.__name__} {key!r} "
                                      f"(found {type(stored.get(key)).__name__}): not a checkpoint of this recipe")
        content = stored.get("content", TRAINING_STATE)
        if content not in (TRAINING_STATE, WEIGHTS_ONLY):
            raise CheckpointError(f"{ckpt_dir}: its common state says content={content!r}, expected "
                                  f"{TRAINING_STATE!r} or {WEIGHTS_ONLY!r}")
        return cls(iteration=int(stored["iteration"]), consumed_samples=int(stored.get("consumed_samples", 0)),
                   config=stored["config"], content=content,
                   optimizer_format=stored.get("optimizer_format",
                                               FORMAT_OF_OLDER_CHECKPOINTS if content == TRAINING_STATE else None),
                   buffer_layouts=stored.get("buffer_layouts"), scheduler=stored.get("opt_param_scheduler"),
                   rng=stored.get("rng_state"), run_state=stored.get("run_state"),
                   version=int(stored.get("common_state_version", 0)))


def read_common(ckpt_dir: Path) -> CommonState:
    """The common state of a checkpoint in any of its formats: a ``common.pt`` (the fsdp_dtensor format's, and
    dist_checkpointing's before megatron-core 0.17), or the ``common_state`` object inside the torch_dist shards
    (megatron-core >= 0.17). Read without unpickling code; a file that cannot be read is one CheckpointError naming
    it."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_ext.checkpoint import safe_unpickle

    safe_unpickle.install()
    stored = None
    try:
        with safe_unpickle.refusals_named(ckpt_dir):
            if (ckpt_dir / COMMON_STATE).is_file():
                stored = torch.load(ckpt_dir / COMMON_STATE, map_location="cpu", weights_only=True)
            elif (ckpt_dir / DIST_METADATA).is_file():
                from megatron.core.dist_checkpointing.serialization import load_common_state_dict

                stored = load_common_state_dict(str(ckpt_dir))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- any unreadable file is the same refusal
        raise CheckpointError(f"{ckpt_dir}: its common state (iteration, config) cannot be read "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): the checkpoint is "
                              "damaged; resume an older one or set it aside") from None
    if stored is None:
        raise CheckpointError(f"neither {ckpt_dir / COMMON_STATE} nor {ckpt_dir / DIST_METADATA} found: {ckpt_dir} "
                              "is not a checkpoint of this recipe")
    return CommonState.from_saved(ckpt_dir, stored)
