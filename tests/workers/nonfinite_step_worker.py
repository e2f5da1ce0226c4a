"""One process: a step whose loss is non-finite (train.skip_nonfinite_steps=1) and a loss spike
(train.spike_policy=skip) are skipped without touching the weights, the optimizer's state (fp32 main weights, Adam
moments, step counts) or the LR schedule.

Trains one ordinary step with the recipe's Trainer (its loss the spike detector's first), snapshots that state, runs
a step whose forward output is multiplied by NaN and one where it is multiplied by 30, and writes
``{"skipped": ..., "unchanged": {...}, "next_step_finite": ...}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from megatron_ext.checkpoint.compat import megatron_optimizers
from megatron_ext.config.schema import load_config
from megatron_ext.distributed.parallel import destroy_distributed
from megatron_ext.training import micro_batch
from megatron_ext.training import trainer as trainer_module
from tests.launch import SINGLE_PROCESS, SMALL_MODEL, TINY


def _state(trainer: trainer_module.Trainer) -> dict[str, list[torch.Tensor] | float]:
    """Copies of what a skipped step must leave alone."""
    inner = [opt.optimizer for opt in megatron_optimizers(trainer.optimizer)]
    return {
        "weights": [p.detach().clone() for chunk in trainer.model for p in chunk.parameters()],
        "main weights": [p.detach().clone() for opt in inner for g in opt.param_groups for p in g["params"]],
        "Adam moments and steps": [v.detach().clone() for opt in inner for s in opt.state.values()
                                   for v in s.values() if torch.is_tensor(v)],
        "LR schedule": float(trainer.scheduler.num_steps),
        "learning rate": float(trainer.optimizer.param_groups[0]["lr"]),
    }


def _same(a, b) -> bool:
    if isinstance(a, float):
        return a == b
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    cfg = load_config(TINY, [*SMALL_MODEL, *SINGLE_PROCESS, "data.mock=true", "model.vocab_size=1000",
                             "data.tokenizer_model=null", "logging.tensorboard_dir=null", "checkpoint.save=null",
                             "train.skip_nonfinite_steps=1", "optimizer.lr_warmup_iters=2",
                             "train.spike_policy=skip", "train.spike_window=5"])
    trainer = trainer_module.Trainer(cfg)
    data = trainer.data.iterators(trainer.data.train)
    trainer.train_step(data)
    trainer._settle(trainer_module.RunResult(iteration=1))  # its loss is the spike detector's first
    before = _state(trainer)

    finite_forward = micro_batch.forward_step
    skipped = []
    for factor in (float("nan"), 30.0):
        def corrupted_forward(data_iterator, model):
            output, loss_func = finite_forward(data_iterator, model)
            return output * factor, loss_func

        micro_batch.forward_step = corrupted_forward
        skipped.append(not trainer.train_step(data))
        micro_batch.forward_step = finite_forward
    after = _state(trainer)
    updated = trainer.train_step(data)
    settled = trainer.pending.settle().steps  # this one: the skipped steps left nothing pending
    result = {"skipped": skipped, "unchanged": {k: _same(before[k], after[k]) for k in before},
              "spikes_skipped": trainer.spikes.acted,
              "next_step_finite": updated and [s.iteration for s in settled] == [1] and math.isfinite(settled[0].loss)}
    args.out.write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
