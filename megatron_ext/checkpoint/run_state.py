"""The loop's run state that decides what happens after a restart, saved with every training checkpoint: one
registry of checkpointable components (torchtitan's ``Stateful``: each has ``state_dict``/``load_state_dict``), so a
new piece of such state is registered once and cannot be left out of the save or the load. Model, optimizer, LR
schedule, RNG and data position have their own places in the checkpoint (:mod:`save_load`); what is here is the
rest (the loss-spike detector and its budget, the non-finite steps skipped against train.skip_nonfinite_steps),
stored in the checkpoint's common state under ``run_state``. The goodput ledger is the run's, not a checkpoint's: it
keeps its own file beside the checkpoints (a rewind to an older checkpoint must not take back the wall time spent
since), and megatron-core's rerun state machine is :mod:`megatron_ext.resilience.reruns`'."""

from __future__ import annotations

from typing import Any, Protocol


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RunState:
    """The registered components, by name."""

    def __init__(self) -> None:
        self.components: dict[str, Stateful] = {}

    def register(self, name: str, component: Stateful) -> None:
        if name in self.components:
            raise ValueError(f"run state component {name!r} is registered twice")
        self.components[name] = component

    def state_dict(self) -> dict[str, Any]:
        return {name: component.state_dict() for name, component in self.components.items()}

    def load_state_dict(self, saved: dict[str, Any] | None) -> list[str]:
        """Each component from its part of `saved` (a checkpoint's ``run_state``; None for one written before it was
        kept); returns the names the checkpoint had no state for, which keep their fresh state."""
        saved = saved or {}
        for name, component in self.components.items():
            if name in saved:
                component.load_state_dict(saved[name])
        return [name for name in self.components if name not in saved]
