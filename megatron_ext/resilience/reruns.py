"""Re-running a step in place (train.rerun_mode), with megatron-core's rerun state machine.

``validate_results``: before a step's update, each rank checks its own loss and gradient sums
(:func:`~megatron_ext.resilience.divergence.step_sums`), and under train.spike_policy=skip the step's loss for a
spike (megatron-core's spiky-loss check, with this project's detector). When one fails on any rank, every rank runs
the step again from the same state: the same micro batches (megatron-core's ``RerunDataIterator`` replays them), random
states, router expert biases and router statistics. If the re-run's sums are finite, the first result was a
transient fault (a flaky GPU, silent data corruption): the step goes on with the re-run's result, and the rank that
saw the fault says so in one line naming its node and device (rank 0, for a spike: every rank sees the same loss).
A spike that recurs is the data's, and train.spike_policy drops the step. If a non-finite fault recurs, the data or
the model made it, or a fault that persists on that device: only a run on another GPU tells. What then is
train.recurring_fault's:

- ``policies``: train.skip_nonfinite_steps and train.spike_policy decide, as without re-runs;
- ``rerun_elsewhere`` (megatron-core's diagnosis): the state before the step is saved as a checkpoint, the node(s)
  and device(s) where the fault began are written beside it (:class:`PendingRerun`) and in the run record, and
  every rank exits 16. The SLURM templates requeue the job without those nodes; there the step runs again. If the
  fault recurs on other GPUs, the data or the model made it, and the policies decide; if not, those GPUs were faulty
  and the run goes on. A job that lands on a suspect GPU again exits 16 before training.

The first step after each start is not checked in place (megatron-core's rule: no checkpoint could yet hold the state
before it).

``report_determinism_stats``: every step runs twice; the relative difference between the two results is
``train/rerun_relative_difference`` and its largest value is said at the end: how far the run is from
bit-reproducible.

What it costs (validate_results): one host sync and one all-reduce per step, since the state machine decides on the
host whether to re-run. Where megatron-core's fatal path exits 17 after the re-run on other GPUs whatever it found
(and after a transient fault), here a transient fault heals in place, a faulty GPU's step goes on once it ran
elsewhere, and a fault that is the data's goes to the run's policies.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional

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

from megatron_ext.checkpoint.layout import RERUN_ELSEWHERE
from megatron_ext.config.schema import RecurringFault, RerunModeName
from megatron_ext.errors import CheckpointError, RerunElsewhereError
from megatron_ext.resilience.run_record import TrainingRecord, node_name, write_training_end
from megatron_ext.storage import files
from megatron_ext.storage.files import write_atomically

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


@dataclass(frozen=True)
class Suspect:
    """Where a fault that recurred in place began: the rank, its node (as SLURM names it) and device."""

    rank: int
    node: str
    device: int
    what: Literal["loss", "gradients"]

    def __str__(self) -> str:
        return f"rank {self.rank}'s {self.what} on node {self.node}, device {self.device}"


@dataclass(frozen=True)
class PendingRerun:
    """Step `iteration`'s fault recurred in place on the `suspects`' GPUs; the checkpoint of the iteration before it
    is where the job resumes to run it on others. Kept in ``<checkpoint.save>/rerun_elsewhere.json`` until then."""

    iteration: int
    suspects: tuple[Suspect, ...]

    @property
    def nodes(self) -> list[str]:
        return sorted({s.node for s in self.suspects})

    def places(self) -> set[tuple[str, int]]:
        return {(s.node, s.device) for s in self.suspects}

    def describe(self) -> str:
        return "; ".join(map(str, self.suspects))

    @staticmethod
    def path(save: str | Path) -> Path:
        return files.at(save) / RERUN_ELSEWHERE

    def write(self, save: str | Path) -> None:
        write_atomically(self.path(save), json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, save: Optional[str | Path]) -> Optional[PendingRerun]:
        """The step waiting to run elsewhere, if one is (checked: a malformed file is one CheckpointError)."""
        path = cls.path(save) if save else None
        if path is None or not path.is_file():
            return None
        try:
            stored = json.loads(path.read_text())
            suspects = tuple(Suspect(**entry) for entry in stored["suspects"])
            pending = cls(iteration=stored["iteration"], suspects=suspects)
            if (type(pending.iteration) is not int or pending.iteration < 1 or not suspects
                    or any(type(s.rank) is not int or type(s.device) is not int or not isinstance(s.node, str)
                           or s.what not in ("loss", "gradients") for s in suspects)):
                raise ValueError("a field out of range")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{path}: not a step to re-run elsewhere ({type(e).__name__}: {e}); expected "
                '{"iteration": N, "suspects": [{"rank": R, "node": "...", "device": D, "what": "loss"}]}: correct it, '
                "or delete it to resume without the diagnosis") from None
        return pending


class StepReruns:
    """train.rerun_mode for one rank's run. The loop runs each step's forward and backward passes once for every item
    of :meth:`runs` and passes each run's :func:`step_sums` to :meth:`check`. `restorable`: tensors that a step's
    forward and backward passes change and a re-run must start from (router expert biases and statistics)."""

    def __init__(self, mode: RerunModeName, restorable: list[torch.Tensor], device: torch.device,
                 recurring_fault: RecurringFault = "policies", is_spike: Optional[Callable[[float], bool]] = None):
        self.mode, self.restorable, self.device = mode, restorable, device
        # validate_results: whether a step's global loss is a spike to re-run (None: spikes are not checked)
        self.is_spike = is_spike if mode == "validate_results" else None
        self._losses: list[float] = []
        self.recurring_fault = recurring_fault
        self.elsewhere = False  # the last step's fault recurred in place: stop, to re-run it on other GPUs
        self.suspects: tuple[Suspect, ...] = ()
        self.pending: Optional[PendingRerun] = None  # a step this run re-runs on other GPUs (see resume)
        self._pending_path: Optional[Path] = None
        self.largest_difference = 0.0  # report_determinism_stats: this rank's, over the run
        self._difference = 0.0  # the last re-run's relative difference from its run
        self.transient_faults = 0  # validate_results: the steps a re-run healed, in this process's life
        self._results: list[torch.Tensor] = []
        self._replayable: tuple[object, object] = (None, None)
        destroy_rerun_state_machine()  # the process's one state machine is this run's (in-process tests build more)
        initialize_rerun_state_machine(mode=RerunMode(mode), state_save_func=self._save,
                                       state_restore_func=self._restore)
        self.machine = get_rerun_state_machine()

    @property
    def device_index(self) -> int:
        """This rank's GPU on its node (0 on the CPU rehearsal)."""
        return self.device.index or 0

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
        self._results, self._losses = [], []
        run = 0
        while self.machine.should_run_forward_backward(data_iterator):
            yield run
            run += 1
        # asks to only after a fault that recurred under rerun_elsewhere; marks the first step done
        self.elsewhere = self.machine.should_checkpoint_and_exit()[0]

    @property
    def checks_spikes(self) -> bool:
        return self.is_spike is not None

    def check(self, sums: torch.Tensor, loss: Optional[float] = None) -> None:
        """This run's loss and gradient sums: megatron-core rejects non-finite ones (a host sync) and compares a
        re-run's with them; `loss`, the step's global loss when :attr:`checks_spikes`, is rejected when a spike."""
        if not self.on:
            return
        if loss is not None:
            self._losses.append(loss)
            self.machine.validate_result(torch.tensor(loss), rejection_func=lambda x: self.is_spike(float(x)),
                                         message="loss spike", comparison_func=relative_difference, tolerance=0.0,
                                         fatal=False)
        self._results.append(sums.detach().clone())
        rerun = len(self._results) == 2
        if rerun:  # the step's scalars keep it; megatron-core compares the two results itself, with the same function
            self._difference = relative_difference(*self._results)
        # megatron-core's fatal check checkpoints (after restoring the state before the step) when a re-run
        # reproduces the result, but also stops after a re-run that does not: fatal only for a reproduced fault
        fatal = (self.recurring_fault == "rerun_elsewhere" and rerun and self._difference == 0.0
                 and self.pending is None)  # a step re-run elsewhere already is the data's when it recurs
        self.machine.validate_result(sums.detach(), rejection_func=lambda s: not bool(torch.isfinite(s).all()),
                                     message="non-finite loss or gradient sum",
                                     comparison_func=relative_difference, tolerance=0.0, fatal=fatal)

    def step_scalars(self) -> dict[str, torch.Tensor]:
        """report_determinism_stats: this step's relative difference between its run and re-run, the largest over the
        ranks, as a device tensor (collective); {} otherwise."""
        if self.mode != "report_determinism_stats" or len(self._results) < 2:
            return {}
        self.largest_difference = max(self.largest_difference, self._difference)
        difference = torch.tensor(self._difference, device=self.device)
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
        return {"train/rerun_relative_difference": difference}

    def outcome(self, iteration: int, sums: torch.Tensor) -> bool:
        """After step `iteration`'s runs, `sums` the last one's: whether a re-run healed it (no rank's fault
        recurred); the ranks where the fault began say what they saw. False without a re-run. Collective after a
        re-run and for a step re-run elsewhere (:meth:`resume`)."""
        if self.pending is not None and self.pending.iteration == iteration:
            self._diagnose(sums)
            return False
        if self.mode != "validate_results" or len(self._results) < 2:
            return False
        first, again = ((~torch.isfinite(r)).tolist() for r in self._results)
        mine = torch.tensor([first[0], any(first) and any(again), any(first)], dtype=torch.int64, device=self.device)
        dist.all_reduce(mine)
        losses_bad, recurred, nonfinite = mine.tolist()
        if not nonfinite:  # re-run for its loss spike
            return self._spike_outcome(iteration)
        # a rank's gradients are non-finite after the data-parallel reduction when another rank's loss was
        began_here = first[0] or (not losses_bad and any(first))
        what = "loss" if first[0] else "gradients"
        if self.elsewhere:
            self.suspects = self._gather_suspects(what if any(again) else None, began_here)
            if began_here:
                log.warning(f"iteration {iteration}: this rank's non-finite {what} recurred when the step was re-run on "
                            f"the same device (node {node_name()}, device {self.device_index}): the job "
                            "saves the state before the step and stops (exit 16) to re-run it on other GPUs "
                            "(train.recurring_fault=rerun_elsewhere)")
            return False
        if began_here:
            where = f"node {node_name()}, device {self.device_index}"
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

    def _spike_outcome(self, iteration: int) -> bool:
        """After a step re-run for its loss spike: whether the re-run healed it (said by rank 0)."""
        first, again = self._losses
        healed = not self.is_spike(again)
        if dist.get_rank() == 0:
            if healed:
                log.warning(f"iteration {iteration}: the loss spike of the step's first run ({first:.4f}) did not recur "
                            f"when it was re-run on the same GPUs ({again:.4f}): a transient fault (a flaky GPU or "
                            "silent data corruption); the step goes on with the re-run's result")
            else:
                log.warning(f"iteration {iteration}: the loss spike recurred when the step was re-run on the same GPUs "
                            f"({first:.4f}, then {again:.4f}): the data made it; train.spike_policy=skip drops it")
        self.transient_faults += healed
        return healed

    def _gather_suspects(self, recurred: Optional[str], began_here: bool) -> tuple[Suspect, ...]:
        """Collective: the ranks where a fault that recurred in place began, else every rank where it recurred
        (`recurred`: this rank's "loss" or "gradients", or None)."""
        entry = (began_here, Suspect(dist.get_rank(), node_name(), self.device_index, recurred)) if recurred else None
        gathered: list[Optional[tuple[bool, Suspect]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entry)
        recurring = [e for e in gathered if e is not None]
        return tuple(suspect for began, suspect in recurring if began) or tuple(s for _, s in recurring)

    def stop_to_rerun_elsewhere(self, iteration: int, save: str, log_dir: str) -> None:
        """After the checkpoint of `iteration - 1` is complete: record the step to re-run elsewhere (beside the
        checkpoints, and in the run record for the SLURM templates) and raise RerunElsewhereError (exit 16)."""
        pending = PendingRerun(iteration, self.suspects)
        if dist.get_rank() == 0:
            pending.write(save)
        self._tell_the_scheduler(pending, iteration - 1, log_dir)
        raise RerunElsewhereError(
            f"iteration {iteration}'s non-finite result recurred when re-run on the same GPUs ({pending.describe()}): "
            f"the checkpoint of iteration {iteration - 1} holds the state before it",
            advice=f"resume without node(s) {','.join(pending.nodes)} (the SLURM templates requeue so; by hand: sbatch "
                   f"--exclude={','.join(pending.nodes)}): the step runs again there, which tells a faulty GPU from "
                   "bad data")

    @staticmethod
    def _tell_the_scheduler(pending: PendingRerun, iteration: int, log_dir: str) -> None:
        if dist.get_rank() == 0:
            write_training_end(log_dir, TrainingRecord("rerun elsewhere", iteration, suspect_nodes=pending.nodes))
        dist.barrier()

    def resume(self, save: Optional[str], iteration: int, log_dir: str) -> None:
        """At the start of training (collective): a step waiting to run elsewhere (:class:`PendingRerun`) after
        `iteration` is diagnosed when it runs; RerunElsewhereError (exit 16) if any rank is on a suspect GPU again."""
        pending = PendingRerun.read(save)
        if pending is None:
            return
        if pending.iteration <= iteration:  # a checkpoint past it was resumed: nothing left to tell apart
            if dist.get_rank() == 0:
                pending.path(save).unlink(missing_ok=True)
            return
        places: list[tuple[str, int]] = [("", 0)] * dist.get_world_size()
        dist.all_gather_object(places, (node_name(), self.device_index))
        again = [(rank, *place) for rank, place in enumerate(places) if place in pending.places()]
        if again:
            self._tell_the_scheduler(pending, iteration, log_dir)
            rank, node, device = again[0]
            raise RerunElsewhereError(
                f"iteration {pending.iteration} is to run on other GPUs than those where its fault recurred "
                f"({pending.describe()}), but rank {rank} is on node {node}, device {device} again",
                advice=f"resume without node(s) {','.join(pending.nodes)} (sbatch --exclude=...; the SLURM templates "
                       f"requeue so), or delete {pending.path(save)} to go on without the diagnosis")
        self.pending, self._pending_path = pending, pending.path(save)
        if dist.get_rank() == 0:
            log.warning(f"iteration {pending.iteration} runs on other GPUs than those where its fault recurred "
                        f"({pending.describe()}): its result tells a faulty GPU from bad data")

    def _diagnose(self, sums: torch.Tensor) -> None:
        """Collective: the step re-run elsewhere, and what its result says."""
        pending, self.pending = self.pending, None
        recurred = torch.tensor(int(not bool(torch.isfinite(sums).all())), device=self.device)
        dist.all_reduce(recurred)
        if dist.get_rank() != 0:
            return
        if recurred.item():
            log.warning(f"iteration {pending.iteration}: the non-finite result that recurred on {pending.describe()} "
                        "recurred on other GPUs too: the data or the model made it, not a GPU; "
                        "train.skip_nonfinite_steps and train.spike_policy decide")
        else:
            log.warning(f"iteration {pending.iteration}: the fault that recurred on {pending.describe()} did not recur "
                        f"on other GPUs: that GPU is faulty; the run goes on (keep node(s) {','.join(pending.nodes)} "
                        "out of later jobs)")
        self._pending_path.unlink(missing_ok=True)

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
