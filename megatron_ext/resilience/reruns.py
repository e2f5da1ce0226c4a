"""Re-running a step in place (train.rerun_mode), with megatron-core's rerun state machine.

``validate_results``: before a step's update, each rank checks its own loss and gradient sums
(:func:`~megatron_ext.resilience.divergence.step_sums`). When one is non-finite on any rank, every rank runs the
step again from the same state: the same micro batches (megatron-core's ``RerunDataIterator`` replays them), random
states, router expert biases and router statistics. If the re-run's sums are finite, the first result was a
transient fault (a flaky GPU, silent data corruption): the step goes on with the re-run's result, and the rank that
saw the fault says so in one line naming its node and device. If the fault recurs, the data or the model made it (or
a fault that persists on that device: only a run on another GPU tells), and train.skip_nonfinite_steps and
train.spike_policy decide as without re-runs. The first step after each start is not checked (megatron-core's rule:
no checkpoint could yet hold the state before it).

``report_determinism_stats``: every step runs twice; the relative difference between the two results is
``train/rerun_relative_difference`` and its largest value is said at the end: how far the run is from
bit-reproducible.

What it costs (validate_results): one host sync and one all-reduce per step, since the state machine decides on the
host whether to re-run. What is not used: megatron-core's fatal path, which checkpoints and exits (16) so that the
job resumes on another GPU to re-run the step there; here a recurring fault is the run's own policies' to handle.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    RerunMode,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_ext.config.schema import RerunModeName

log = logging.getLogger("megatron_ext")


def relative_difference(initial: torch.Tensor, rerun: torch.Tensor) -> float:
    """0 when the two results agree exactly, inf when they differ in which values are NaN, +inf or -inf, else the
    largest relative difference of their finite values."""
    a, b = initial.double().cpu(), rerun.double().cpu()
    if any(not torch.equal(kind(a), kind(b)) for kind in (torch.isnan, torch.isposinf, torch.isneginf)):
        return math.inf
    finite = torch.isfinite(a)
    a, b = a[finite], b[finite]
    scale = torch.maximum(a.abs(), b.abs())
    nonzero = scale > 0
    return float(((a - b).abs()[nonzero] / scale[nonzero]).max()) if bool(nonzero.any()) else 0.0


class StepReruns:
    """train.rerun_mode for one rank's run. The loop runs each step's forward and backward passes once for every item
    of :meth:`runs` and passes each run's :func:`step_sums` to :meth:`check`. `restorable`: tensors that a step's
    forward and backward passes change and a re-run must start from (router expert biases and statistics)."""

    def __init__(self, mode: RerunModeName, restorable: list[torch.Tensor], device: torch.device):
        self.mode, self.restorable, self.device = mode, restorable, device
        self.largest_difference = 0.0  # report_determinism_stats: this rank's, over the run
        self._difference = 0.0  # the last re-run's, as megatron-core's comparison found it
        self.transient_faults = 0  # validate_results: the steps a re-run healed, in this process's life
        self._results: list[torch.Tensor] = []
        self._replayable: tuple[object, object] = (None, None)
        destroy_rerun_state_machine()  # the process's one state machine is this run's (in-process tests build more)
        initialize_rerun_state_machine(mode=RerunMode(mode), state_save_func=self._save,
                                       state_restore_func=self._restore)
        self.machine = get_rerun_state_machine()

    @property
    def on(self) -> bool:
        return self.mode != "disabled"

    def replayable(self, data_iterator):
        """`data_iterator` (one, or one per model chunk) able to replay a step's micro batches; the same wrappers
        while the loop passes the same iterators."""
        if not self.on:
            return data_iterator
        source, wrapped = self._replayable
        if source is not data_iterator:
            wrapped = ([RerunDataIterator(it) for it in data_iterator] if isinstance(data_iterator, list)
                       else RerunDataIterator(data_iterator))
            self._replayable = (data_iterator, wrapped)
        return wrapped

    def runs(self, data_iterator) -> Iterator[int]:
        """Yields 0 for the step's run, 1 for its re-run when megatron-core's state machine asks for one (collective
        then; every rank re-runs)."""
        self._results = []
        run = 0
        while self.machine.should_run_forward_backward(data_iterator):
            yield run
            run += 1
        self.machine.should_checkpoint_and_exit()  # never asks to (non-fatal checks); marks the first step done

    def check(self, sums: torch.Tensor) -> None:
        """This run's loss and gradient sums: megatron-core rejects non-finite ones (a host sync) and compares a
        re-run's with them."""
        if not self.on:
            return
        self._results.append(sums.detach().clone())
        self.machine.validate_result(sums.detach(), rejection_func=lambda s: not bool(torch.isfinite(s).all()),
                                     message="non-finite loss or gradient sum", comparison_func=self._compare,
                                     tolerance=0.0, fatal=False)

    def _compare(self, initial: torch.Tensor, rerun: torch.Tensor) -> float:
        """megatron-core's comparison of a re-run's result with its run's, kept for the step's scalars."""
        self._difference = relative_difference(initial, rerun)
        return self._difference

    def step_scalars(self) -> dict[str, torch.Tensor]:
        """report_determinism_stats: this step's relative difference between its run and re-run, the largest over the
        ranks, as a device tensor (collective); {} otherwise."""
        if self.mode != "report_determinism_stats" or len(self._results) < 2:
            return {}
        self.largest_difference = max(self.largest_difference, self._difference)
        difference = torch.tensor(self._difference, device=self.device)
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
        return {"train/rerun_relative_difference": difference}

    def outcome(self, iteration: int) -> bool:
        """validate_results, after a step that was re-run (collective then): whether the re-run healed it (no rank's
        fault recurred); the ranks where the fault began say what they saw. False without a re-run."""
        if self.mode != "validate_results" or len(self._results) < 2:
            return False
        first, again = ((~torch.isfinite(r)).tolist() for r in self._results)
        mine = torch.tensor([first[0], any(first) and any(again)], dtype=torch.int64, device=self.device)
        dist.all_reduce(mine)
        losses_bad, recurred = mine.tolist()
        # a rank's gradients are non-finite after the data-parallel reduction when another rank's loss was
        if first[0] or (not losses_bad and any(first)):
            what = "loss" if first[0] else "gradients"
            where = f"node {os.uname()[1]}, device {torch.cuda.current_device()}"
            if any(again):
                log.warning(f"iteration {iteration}: this rank's non-finite {what} recurred when the step was re-run on "
                            f"the same device ({where}): the data or the model made it, or a fault that persists on "
                            "this device; train.skip_nonfinite_steps and train.spike_policy decide")
            else:
                log.warning(f"iteration {iteration}: this rank's non-finite {what} did not recur when the step was "
                            f"re-run on the same device ({where}): a transient fault (a flaky GPU or silent data "
                            "corruption); the step goes on with the re-run's result. If it recurs on this node, "
                            "drain it")
        healed = not recurred
        self.transient_faults += healed
        return healed

    def _save(self) -> dict:
        """What megatron-core's state machine saves before a step (it saves the Python, NumPy, torch and CUDA random
        states itself)."""
        return {"rng_tracker": get_cuda_rng_tracker().get_states(),
                "restorable": [t.detach().clone() for t in self.restorable]}

    def _restore(self, saved: dict) -> None:
        get_cuda_rng_tracker().set_states(dict(saved["rng_tracker"]))  # the tracker keeps the dict it is given
        for tensor, value in zip(self.restorable, saved["restorable"]):
            tensor.data.copy_(value)
        # megatron-core's MoE and MTP loss trackers hold the step's values (read and cleared after every step)
        get_moe_metrics_tracker().clear()
        MTPLossLoggingHelper.clean_metrics_in_tracker()

    def summary(self) -> str:
        """The run's line about its re-runs ("" when there is nothing to say); collective under
        report_determinism_stats."""
        if self.mode == "report_determinism_stats":
            largest = torch.tensor(self.largest_difference, device=self.device)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            return ("train.rerun_mode=report_determinism_stats: every step was run twice; the two results' loss and "
                    f"gradient sums differed by at most {float(largest):.3g} (relative; 0 = bit-reproducible)")
        if self.transient_faults:
            return (f"train.rerun_mode=validate_results: {self.transient_faults} step(s) with a transient fault healed "
                    "by re-running them (the lines of the ranks that saw it name their nodes)")
        return ""

    def close(self) -> None:
        destroy_rerun_state_machine()
