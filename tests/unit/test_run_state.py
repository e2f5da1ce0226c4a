"""The run-state registry holds every stateful part of the training loop: a test builds the loop (one CPU process,
mock data) and lists its parts that have a ``state_dict`` and a ``load_state_dict``; each must be registered or have
its own place in the checkpoint. And the non-finite-step budget, like the spike budget, survives a restart and never
comes back at a rewind."""

from __future__ import annotations

from megatron_ext.config.schema import load_config
from megatron_ext.resilience.divergence import NonFiniteSteps
from tests.launch import TINY

# the loop's stateful parts the checkpoint keeps elsewhere than the registry, and why
SAVED_ELSEWHERE = {"optimizer": "its own sharded state", "scheduler": "the checkpoint's common state",
                   "run_state": "the registry itself"}


def _stateful_parts(save: str) -> tuple[list[str], list[str]]:
    """In a world of one: the Trainer's attributes that are Stateful-shaped, and those the registry holds."""
    from megatron_ext.distributed.parallel import destroy_distributed
    from megatron_ext.training.trainer import Trainer

    cfg = load_config(TINY, ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                             "parallel.sequence_parallel=false", "data.mock=true", "data.blend=null",
                             "model.vocab_size=256", f"checkpoint.save={save}", "logging.tensorboard_dir=null",
                             f"logging.log_dir={save}/logs", "train.train_iters=1"])
    trainer = Trainer(cfg)
    try:
        parts = {name: obj for name, obj in vars(trainer).items()
                 if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))}
        registered = [name for name, obj in parts.items()
                      if any(obj is component for component in trainer.run_state.components.values())]
        return sorted(parts), sorted(registered)
    finally:
        trainer.watchdog.close()
        trainer.checkpointer.abort()
        trainer.run_logger.close()
        destroy_distributed()


def test_every_stateful_part_of_the_loop_is_registered(megatron, tmp_path):
    parts, registered = megatron(_stateful_parts, str(tmp_path / "ckpt"))
    assert {"spikes", "nonfinite"} <= set(registered)
    assert sorted(set(parts) - set(SAVED_ELSEWHERE)) == registered, parts


def test_the_nonfinite_budget_survives_a_restart_and_never_comes_back():
    spent = NonFiniteSteps(allowed=2, lr=1e-3, speak=False)
    spent.skip_or_raise("a NaN loss")
    restarted = NonFiniteSteps(allowed=2, lr=1e-3, speak=False)
    restarted.load_state_dict(spent.state_dict())
    assert restarted.skipped == 1 and restarted.can_skip
    restarted.skip_or_raise("another NaN loss")
    restarted.load_state_dict({"skipped": 1})  # a rewind to the older checkpoint
    assert restarted.skipped == 2 and not restarted.can_skip
