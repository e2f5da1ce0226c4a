"""The recipe's entry point with hardware-like faults on one rank (FAULTY_RANK): the forward output of the step at
TRANSIENT_AT is made NaN on that step's first run only (a fault that a re-run on the same device does not meet
again), that of the step at RECURRING_AT on every run (as bad data or a bad model would) — with FAULTY_NODE, only
on that node (as SLURMD_NODENAME names it: a GPU that fails the same way each time). TRANSIENT_SPIKE_AT and
RECURRING_SPIKE_AT double the output instead: a loss spike. FAULTY_NODE_FROM: from that step on, every run of a
step goes wrong on every rank of FAULTY_NODE, wherever the pipeline placed them (a node gone bad): the last stage's
loss is NaN, an earlier stage's gradients (a NaN output there would show first in another node's loss)."""

from __future__ import annotations

import os

from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

from megatron_ext.resilience.run_record import node_name
from recipes.pretrain import entry_point
from tests.workers.step_patch import forward_step_per_step


def _faulty_node(plain):
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    def forward_step_on_a_faulty_node(data_iterator, model):
        output, loss_func = plain(data_iterator, model)
        if last_stage:
            return output * float("nan"), loss_func
        output.register_hook(lambda grad: grad * float("nan"))
        return output, loss_func

    return forward_step_on_a_faulty_node


def _choose(step, plain):
    if "FAULTY_NODE_FROM" in os.environ:
        bad = os.environ["FAULTY_NODE"] == node_name() and step.iteration + 1 >= int(os.environ["FAULTY_NODE_FROM"])
        return _faulty_node(plain) if bad else plain
    iteration, rank = str(step.iteration + 1), os.environ["RANK"]
    faults = {name: iteration == os.environ.get(name) for name in
              ("TRANSIENT_AT", "RECURRING_AT", "TRANSIENT_SPIKE_AT", "RECURRING_SPIKE_AT")}
    faults["RECURRING_AT"] &= os.environ.get("FAULTY_NODE", node_name()) == node_name()
    if rank != os.environ["FAULTY_RANK"] or not any(faults.values()):
        return plain
    factor = float("nan") if faults["TRANSIENT_AT"] or faults["RECURRING_AT"] else 2.0
    recurring = faults["RECURRING_AT"] or faults["RECURRING_SPIKE_AT"]

    def forward_step_with_a_fault(data_iterator, model):
        output, loss_func = plain(data_iterator, model)
        first_run = get_rerun_state_machine().state == RerunState.INITIAL_RUN
        return (output * factor if recurring or first_run else output), loss_func

    return forward_step_with_a_fault


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    forward_step_per_step(_choose)
    entry_point()
