"""The pretraining loop: megatron-core schedules, DDP, optimizer and LR schedule, eval, checkpoints, signals. A step
that neither logs, evaluates, saves nor stops never waits for the device (:mod:`.pending_steps`)."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import LayerWiseDistributedOptimizer, MegatronOptimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from tqdm import tqdm

from megatron_ext.checkpoint.compat import megatron_optimizers
from megatron_ext.checkpoint.layout import progress_path
from megatron_ext.checkpoint.manager import CheckpointManager
from megatron_ext.checkpoint.resume import Resumed, load_weights_before_sharding
from megatron_ext.checkpoint.run_state import RunState
from megatron_ext.config.kernels import uses_transformer_engine
from megatron_ext.config.schema import (
    RecipeConfig,
    collective_timeout_minutes,
    data_parallel_size,
    decides_before_update,
    hang_timeout_s,
    log_dir,
    microbatches_per_step,
)
from megatron_ext.data.tokenizer import VocabOnlyTokenizer, load_tokenizer
from megatron_ext.distributed import cpu_backend
from megatron_ext.distributed.parallel import (
    describe_sharding,
    destroy_distributed,
    device,
    init_distributed,
    stop_data_parallel_communication,
    wrap_with_ddp,
)
from megatron_ext.distributed.tp_comm_overlap import initialize_userbuffers
from megatron_ext.errors import DivergenceError
from megatron_ext.metrics.goodput_ledger import GoodputLedger, Ledger
from megatron_ext.metrics.moe_metrics import RouterMetrics
from megatron_ext.metrics.mtp_metrics import MTPMetrics
from megatron_ext.metrics.profiler import StepProfiler
from megatron_ext.metrics.run_logger import RunLogger, StartupClock
from megatron_ext.metrics.step_metrics import StepMetrics
from megatron_ext.model import activation_offload
from megatron_ext.model.build import build_model
from megatron_ext.model.document_mask import uses_packed_sequences
from megatron_ext.model.llama import transformer_engine_available
from megatron_ext.model.moe import expert_biases
from megatron_ext.planner.goodput import checkpoint_write_s
from megatron_ext.planner.timeouts import checkpoint_io_limit_s, hang_ceiling_s
from megatron_ext.resilience import flight_recorder
from megatron_ext.resilience.divergence import (
    NonFiniteSteps,
    check_loss_scale_floor,
    describe_nonfinite,
    nonfinite_flags,
    step_sums,
)
from megatron_ext.resilience.elastic import ProgressRecord
from megatron_ext.resilience.exit_signal import ExitSignal
from megatron_ext.resilience.failures import out_of_memory_advice, report_failure
from megatron_ext.resilience.process_guard import die_with_parent, raise_if_launcher_gone
from megatron_ext.resilience.reruns import StepReruns
from megatron_ext.resilience.spikes import REWIND_REASON, LossSpikes, Spike
from megatron_ext.resilience.watchdog import HangWatchdog
from megatron_ext.training import micro_batch, qk_clip
from megatron_ext.training.cuda_graphs import StepGraphs
from megatron_ext.training.optimizer import (
    build_optimizer,
    build_scheduler,
    describe_offload,
    offload_stand_ins,
    select_torch_adam_kernel,
    update_kernel,
)
from megatron_ext.training.pending_steps import PendingSteps, SettledStep, global_mean_loss
from megatron_ext.training.run_data import RunData

log = logging.getLogger("megatron_ext")


@dataclass
class RunResult:
    """What a finished (or signalled) run reports; the same on every rank."""

    iteration: int
    train_losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    test_loss: Optional[float] = None  # on the test split after the last iteration (where there is one)
    step_times: list[float] = field(default_factory=list)
    startup: str = ""  # the time to the first step and its parts
    goodput: Optional[Ledger] = None  # where the run's wall-clock went since its first start (rank 0's)
    plan_check: list[str] = field(default_factory=list)  # the measured step breakdown beside the planner's (rank 0)
    checkpoint: Optional[Path] = None
    stopped_early: bool = False  # by a signal or train.exit_interval, before train_iters
    stopped_by_signal: bool = False


class RunFailed(Exception):
    """This rank failed and has said so (once for the job, traceback in its log); carries the exit code."""

    def __init__(self, exit_code: int):
        super().__init__(exit_code)
        self.exit_code = exit_code


def _describe_grad_sync(model: list, optimizer: MegatronOptimizer) -> str:
    """How gradients and parameters move over DP×CP, read from megatron-core's DDP and optimizer objects."""
    ddp = model[0].ddp_config
    distributed = [type(opt).__name__ == "DistributedOptimizer" for opt in megatron_optimizers(optimizer)]
    dp_cp = parallel_state.get_data_parallel_world_size(True)
    if isinstance(optimizer, LayerWiseDistributedOptimizer) or any(
            isinstance(opt, LayerWiseDistributedOptimizer) for opt in getattr(optimizer, "chained_optimizers", [])):
        state = f"layer-wise distributed optimizer (Muon's matrices whole, each on one of DP×CP={dp_cp} ranks)"
    else:
        state = (f"distributed optimizer (state sharded over DP×CP={dp_cp})" if all(distributed)
                 else "replicated optimizer state")
    overlap = [name for name, on in [("overlapped grad reduce", ddp.overlap_grad_reduce),
                                     ("overlapped param gather", ddp.overlap_param_gather)] if on]
    return f"{state}; grad sync: {', '.join(overlap) or 'after the backward pass'}"


class Trainer:
    """Builds the model, optimizer, schedule and data for one rank, then trains."""

    def __init__(self, cfg: RecipeConfig, startup: Optional[StartupClock] = None):
        self.cfg = cfg
        self.where = "start-up"  # what this rank is doing, for failure messages
        self.startup = startup or StartupClock()
        self.on_gpu = not cpu_backend.install()
        # forked before the process groups start their threads; it must not outlive its rank
        if CheckpointManager.start_save_helper(cfg, die_with_parent):
            self.startup.mark("checkpoint save helper process")
        flight_recorder.enable(log_dir(cfg))  # before the process groups: torch reads it when it creates them
        init_distributed(cfg, self.on_gpu, uses_transformer_engine(cfg, self.on_gpu, transformer_engine_available()))
        initialize_userbuffers(cfg)  # parallel.tp_comm_overlap: before TE's layers are built
        self.startup.mark("process groups")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.dp_size = data_parallel_size(cfg, self.world_size)
        micro_batch.set_up_micro_batch_calculator(self.rank, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                                  self.dp_size)
        self.tokenizer = (VocabOnlyTokenizer(cfg.model.vocab_size) if cfg.data.mock
                          else load_tokenizer(cfg.data.tokenizer_model, cfg.data.tokenizer_type))
        vocab = cfg.model.vocab_size or self.tokenizer.vocab_size
        cfg, self.config, chunks = build_model(cfg, vocab, self.on_gpu)
        self.cfg = cfg  # with its `auto` kernel options decided
        start = load_weights_before_sharding(cfg, chunks)  # Megatron-FSDP only: it shards what the chunks hold
        self.model = wrap_with_ddp(chunks, self.config, cfg)
        self.optimizer = build_optimizer(cfg, self.model, self.on_gpu)
        if cfg.optimizer.optimizer_cpu_offload:
            self._info(describe_offload(self.optimizer))
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self._wire_schedule_hooks()
        self.startup.mark("model and optimizer")
        # an orphan must not complete a checkpoint (its shards stay without a manifest, which a resume ignores)
        self.run_state = RunState()  # what decides the run after a restart: registered by _build_monitors
        self.checkpointer = CheckpointManager(cfg, self.model, self.optimizer, self.scheduler, self.on_gpu,
                                              before_commit=raise_if_launcher_gone, run_state=self.run_state)
        try:
            resumed = self._load_state(partial(self.checkpointer.load, start))
        except BaseException:
            self.checkpointer.abort()  # gives back the run lock it may have taken
            raise
        self.iteration = resumed.iteration
        self.graphs = StepGraphs(cfg, self.config, self.model, self.optimizer, start_iteration=self.iteration)
        self.startup.mark("checkpoint load" if resumed.checkpoint else "run lock (no checkpoint to load)")
        self.progress = ProgressRecord(progress_path(cfg.checkpoint.save), self.rank, self.world_size, self.dp_size,
                                       self.num_microbatches)
        self.restart = self.progress.restart(self.iteration)
        if self.restart:
            self.startup.not_before(self.restart.before.time)
        self._info(f"optimizer: {update_kernel(self.optimizer)}; " + (
            describe_sharding(self.model) if cfg.parallel.use_megatron_fsdp
            else _describe_grad_sync(self.model, self.optimizer)))
        if cfg.train.precision == "fp16" and self.on_gpu and torch.cuda.is_bf16_supported():
            self._info(f"note: {torch.cuda.get_device_name()} supports bf16, which needs no loss scaling and is "
                       f"preferred there (train.precision=bf16); fp16 is for GPUs without it (V100, T4)")
        self.data = RunData(cfg, self.tokenizer, len(self.model), self.dp_size, speak=self.rank == 0)
        self.data.go_on(self.iteration, resumed.consumed_samples)
        self.startup.mark("dataset indices")
        if not cfg.data.mock:
            self.data.say_how_it_was_tokenized()
        self.run_logger = RunLogger(cfg, vocab, self.world_size, enabled=self.rank == 0)
        self.goodput = GoodputLedger(cfg.checkpoint.save, self.startup.start, writer=self.rank == 0)
        self._build_monitors(vocab)
        self._restore_run_state(resumed.run_state if resumed else None)

    def _load_state(self, load: Callable[[], Optional[Resumed]]) -> Optional[Resumed]:
        """A checkpoint load: the offloaded optimizer state re-split around it, the Adam kernel flags it restores
        set after it."""
        with offload_stand_ins(self.cfg, self.model, self.on_gpu):
            resumed = load()
        select_torch_adam_kernel(self.optimizer, fused=self.cfg.optimizer.fused_adam)
        return resumed

    @property
    def consumed_samples(self) -> int:
        return self.data.consumed_samples

    def _build_monitors(self, vocab_size: int) -> None:
        """Divergence, step re-runs, loss spikes, stragglers, hangs (each off when its setting is null or off) and the
        profiler."""
        t = self.cfg.train
        self.nonfinite = NonFiniteSteps(t.skip_nonfinite_steps, self.cfg.optimizer.lr, speak=self.rank == 0)
        self.spikes = LossSpikes(t)
        self.run_state.register("spikes", self.spikes)
        self.run_state.register("nonfinite_steps", self.nonfinite)
        self.metrics = StepMetrics(self.cfg, self.run_logger, device())
        self.pending = PendingSteps(device())
        self.decide_before_update = decides_before_update(self.cfg)  # such runs settle every step
        self.router_metrics = RouterMetrics(self.cfg, device(), self.model)
        self.mtp_metrics = MTPMetrics(self.cfg, device())
        self.reruns = StepReruns(t.rerun_mode, [self.router_metrics.counts, self.router_metrics.tokens,
                                                *expert_biases(self.model)], device(), t.recurring_fault,
                                  self.spikes.would_skip if self.spikes.decides_before_update else None)
        self.config.timers = self.metrics.core_timers
        hang_s, collective_minutes = hang_timeout_s(self.cfg), collective_timeout_minutes(self.cfg)
        io_limit_s = None if hang_s is None else checkpoint_io_limit_s(
            hang_s, checkpoint_write_s(self.cfg, vocab_size=vocab_size), collective_minutes)
        self.watchdog = HangWatchdog(hang_s, log_dir(self.cfg), self.rank, self.world_size,
                                     ceiling_s=hang_ceiling_s(collective_minutes), io_limit_s=io_limit_s)
        self.profiler = StepProfiler(self.cfg, self.rank, self.on_gpu)

    def loss_scale(self) -> Optional[float]:
        """fp16's current loss scale; None without one (bf16, fp32)."""
        return self.optimizer.get_loss_scale().item() if self.cfg.train.precision == "fp16" else None

    def _wire_schedule_hooks(self) -> None:
        """The callbacks megatron-core's schedules use for grad sync, param gather and grad finalisation."""
        chunks = self.model
        single = len(chunks) == 1
        self.config.no_sync_func = chunks[0].no_sync if single else [c.no_sync for c in chunks]
        if self.cfg.parallel.overlap_grad_reduce:
            sync = [c.start_grad_sync for c in chunks]
            self.config.grad_sync_func = sync[0] if single else sync
        if self.cfg.parallel.overlap_param_gather:
            gather = [c.start_param_sync for c in chunks]
            self.config.param_sync_func = gather[0] if single else gather
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss

    def _info(self, message: str) -> None:
        if self.rank == 0:
            log.info(message)

    @property
    def num_microbatches(self) -> int:
        return microbatches_per_step(self.cfg, self.world_size)

    def _run_schedule(self, data_iterator, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        seq_length, micro_batch_size = self.cfg.model.seq_length, self.cfg.train.micro_batch_size
        packed = uses_packed_sequences(self.cfg.data, use_te=self.cfg.model.attention_backend == "te")
        if packed:  # one row of micro_batch_size × seq_length tokens between pipeline stages too
            seq_length, micro_batch_size = seq_length * micro_batch_size, 1
        return self.graphs.results(self.graphs.schedule(get_forward_backward_func())(
            forward_step_func=partial(micro_batch.forward_step, packed_documents=True) if packed
            else micro_batch.forward_step,
            data_iterator=data_iterator,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=self.num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        ))

    def train_step(self, data_iterator) -> bool:
        """One global batch: forward/backward through the pipeline schedule, then one optimizer step, its numbers
        left pending on the device; False when it was skipped: a non-finite loss or gradient under
        train.skip_nonfinite_steps, a loss spike under train.spike_policy=skip, or an fp16 overflow (weights and
        schedule unchanged either way). Under train.rerun_mode a step may run twice before its update."""
        data_iterator = self.reruns.replayable(data_iterator)
        for run in self.reruns.runs(data_iterator):
            if run:  # the step's first run was for nothing: recomputed work in the goodput ledger
                self.goodput.spent("recomputed")
            with self.metrics.timers.region("optimizer"):
                for chunk in self.model:
                    chunk.train()
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                if self.cfg.model.qk_clip:
                    qk_clip.forget_max_logits([chunk.module for chunk in self.model])
            losses = self._run_schedule(data_iterator, forward_only=False)
            with self.metrics.timers.region("loss_sync"):
                # fp16's overflowing gradients are the grad scaler's to skip, not a divergence
                sums = step_sums(losses, self.model, device(), check_grads=self.cfg.train.precision != "fp16")
                self.reruns.check(sums, global_mean_loss(losses, device()) if self.reruns.checks_spikes else None)
        healed = self.reruns.outcome(self.iteration + 1, sums)
        if self.reruns.elsewhere:  # nothing of this step is kept: the job re-runs it on other GPUs
            return False
        if healed:
            self.run_logger.transient_faults(self.iteration + 1, self.reruns.transient_faults)
        with self.metrics.timers.region("loss_sync"):
            router = {**self.router_metrics.step(self.iteration + 1, self.num_microbatches),
                      **self.mtp_metrics.step(self.num_microbatches), **self.reruns.step_scalars()}
            flags = nonfinite_flags(sums)
            self.pending.add(self.iteration + 1, self.consumed_samples, losses, flags, router,
                             self.optimizer.param_groups[0]["lr"])
            loss, nonfinite = self.pending.newest_now() if self.decide_before_update else (None, False)
        # past train.skip_nonfinite_steps under train.spike_policy=rewind, the step goes on and its settling rewinds
        if nonfinite and (self.nonfinite.can_skip or self.spikes.policy != "rewind"):
            self.pending.drop_newest()
            self.nonfinite.skip_or_raise(describe_nonfinite(self.iteration + 1, flags))
            return False
        spike = (self.spikes.before_update(self.iteration + 1, loss, self.consumed_samples)
                 if self.decide_before_update else None)
        if spike:
            self.pending.drop_newest()
            self.run_logger.loss_spike(spike, self.spikes.count("skipped"))
            return False
        scale = self.loss_scale()
        with self.metrics.timers.region("optimizer"):
            ok, grad_norm, _ = self.optimizer.step()
            if ok and self.cfg.model.qk_clip:
                qk_clip.clip_after_update([chunk.module for chunk in self.model])
        if not ok:  # the fp16 grad scaler found an overflow and skipped the step (bf16 and fp32 have no scaler)
            self.pending.drop_newest()
            check_loss_scale_floor(self.iteration + 1, scale, self.cfg.train.min_loss_scale, self.cfg.optimizer.lr)
            self.run_logger.overflow(self.iteration + 1, scale, self.loss_scale())
            return False
        self.scheduler.step(increment=1)
        self.pending.updated(grad_norm)
        return True

    @torch.no_grad()
    def evaluate(self, dataset) -> Optional[float]:
        """Mean loss over train.eval_iters fixed batches of `dataset` (the same ones at every evaluation)."""
        if dataset is None or self.cfg.train.eval_iters == 0:
            return None
        for chunk in self.model:
            chunk.eval()
        it = self.data.iterators(dataset)
        losses = []
        for _ in range(self.cfg.train.eval_iters):
            losses.extend(self._run_schedule(it, forward_only=True))
            self.watchdog.step_done(self.iteration)  # an evaluation batch is progress: a long evaluation is no hang
        self.metrics.discard()  # evaluation's forward passes are not part of a training step
        return global_mean_loss(losses, device())

    def _evaluation_due(self) -> bool:
        """Validation every train.eval_interval steps and after the last one."""
        t = self.cfg.train
        return self.iteration % t.eval_interval == 0 or self.iteration == t.train_iters

    def _evaluate_if_due(self, result: RunResult) -> None:
        if not self._evaluation_due():
            return
        t = self.cfg.train
        self.where = f"evaluation after iteration {self.iteration}"
        val = self.evaluate(self.data.valid)
        if val is not None:
            result.val_losses[self.iteration] = val
            self.run_logger.evaluation("val", self.iteration, val)
        if self.iteration == t.train_iters:  # the held-out test split, once, on the finished model
            self.where = "evaluation on the test split"
            result.test_loss = self.evaluate(self.data.test)
            if result.test_loss is not None:
                self.run_logger.evaluation("test", self.iteration, result.test_loss)
        self.watchdog.step_done(self.iteration)
        self.goodput.spent("evaluation")

    def _checkpoint(self, stopping: bool, clock_due: bool = False) -> Optional[Path]:
        """The step's checkpoint work: background saves that finished are completed; a checkpoint is written
        when one is due. Returns the path written (or started), else None."""
        if not self.checkpointer.due(self.iteration, stopping, clock_due):
            return None
        self.where = f"checkpoint save at iteration {self.iteration}"
        with self.watchdog.timed(f"the checkpoint save of iteration {self.iteration}"):
            path, stall = self.checkpointer.save(self.iteration, self.consumed_samples)
        self.goodput.spent("checkpoint")
        self.goodput.write()  # as current as the checkpoint a restart resumes
        self.run_logger.goodput(self.iteration, self.goodput.ledger)
        self._info(f"{'started saving' if self.checkpointer.asynchronous else 'saved'} checkpoint {path}; "
                   f"training stalled {stall:.1f} s")
        self.run_logger.checkpoint_stall(self.iteration, stall)
        return path

    def _stop_to_rerun_elsewhere(self, result: RunResult) -> None:
        """The step after this iteration met a fault that recurred in place (train.recurring_fault=rerun_elsewhere):
        the steps before it recorded, the state before it saved (unless the interval just did), then exit 16."""
        self._settle(result)
        if self.checkpointer.saved_iteration != self.iteration:
            self._checkpoint(stopping=True)
        self.checkpointer.close()  # complete before the job is requeued
        self.where = f"iteration {self.iteration + 1}"
        self.reruns.stop_to_rerun_elsewhere(self.iteration + 1, self.cfg.checkpoint.save, log_dir(self.cfg))

    def _settles(self, exit_interval: bool, first: bool) -> bool:
        """Whether this step boundary reads the device: the first step (the start-up line reports its time), a
        logging step, an evaluation, a save by the interval, train.exit_interval, the last step, and every step where
        a decision precedes the update (fp16, train.skip_nonfinite_steps). A signal or the clock is acted on at the
        next such boundary."""
        return (first or self.decide_before_update or exit_interval
                or self.iteration % self.cfg.logging.log_interval == 0 or self._evaluation_due()
                or self.checkpointer.due(self.iteration, exit_interval))

    def _settle(self, result: RunResult) -> bool:
        """The pending steps' numbers, read at once (one wait for the device), each recorded in order: results,
        metrics (console, TensorBoard, breakdown, stragglers, advice) and loss spikes. A non-finite step stops the
        run here, after the steps before it are recorded. True when a loss spike rewound the run
        (train.spike_policy=rewind): the steps after it are dropped."""
        settled = self.pending.settle()
        bad = settled.first_nonfinite
        for step in settled.steps:
            if bad and step.iteration >= bad[0]:
                description = describe_nonfinite(*bad)
                spike = self.spikes.nonfinite(step.iteration, step.first_sample, description)
                if spike:
                    self._rewind(result, spike)
                    return True
                self.nonfinite.skip_or_raise(description)
                return False
            spike = self._record_step(result, step)
            if spike and self.spikes.policy == "rewind":
                self._rewind(result, spike)
                return True
        return False

    def _record_step(self, result: RunResult, step: SettledStep) -> Optional[Spike]:
        """A settled step into the results and metrics; its loss spike, if it was one (said unless rewound past)."""
        it, loss = step.iteration, step.loss
        result.train_losses[it] = loss
        result.grad_norms[it] = step.grad_norm
        result.step_times.append(step.step_time)
        self.metrics.record(it, loss, step.lr, step.grad_norm, step.step_time, self.loss_scale(), step.router)
        spike = self.spikes.settled(it, loss, step.first_sample)
        if spike and self.spikes.policy == "warn":
            self.run_logger.loss_spike(spike)
        return spike

    def _restore_run_state(self, saved: Optional[dict]) -> None:
        """The registered components from a checkpoint's run state; the spike budget also counts the rewinds the
        data skips recorded since (a rewind after the checkpoint, lost with the process, still counts)."""
        self.run_state.load_state_dict(saved)
        self.spikes.count_recorded_rewinds(sum(skip.reason.startswith(REWIND_REASON) for skip in self.data.skips.entries))

    def _rewind(self, result: RunResult, spike: Spike) -> None:
        """Back to checkpoint.save's newest checkpoint; the data goes on after the spike's global batch, a skip
        recorded for restarts (:mod:`megatron_ext.checkpoint.data_skips`)."""
        self.where = f"rewind after the loss spike at iteration {spike.iteration}"
        self.goodput.step_done(self.iteration)
        with self.watchdog.timed(f"the checkpoint load of the rewind after iteration {spike.iteration}"):
            resumed = self._load_state(self.checkpointer.rewind)
        self.goodput.spent("startup")  # the reload is recovery
        if resumed is not None:
            self._restore_run_state(resumed.run_state)
        self.goodput.write()
        if resumed is None:
            raise DivergenceError(
                f"{spike.describe()}; train.spike_policy=rewind found no checkpoint in checkpoint.save="
                f"{self.cfg.checkpoint.save} to go back to: save earlier (checkpoint.save_interval) or use "
                f"train.spike_policy=skip")
        self.iteration = resumed.iteration
        for later in [it for it in result.train_losses if it > self.iteration]:
            del result.train_losses[later], result.grad_norms[later]
        self.run_logger.loss_spike(spike, self.spikes.count(
            f"rewound to iteration {resumed.iteration} ({resumed.checkpoint})"), rewinds=self.spikes.acted)
        self.data.skip_to(resumed.iteration, resumed.consumed_samples, spike.samples[1] + 1,
                          f"{REWIND_REASON} at iteration {spike.iteration}")

    def train(self) -> RunResult:
        cfg, t = self.cfg, self.cfg.train
        result = RunResult(iteration=self.iteration)
        exit_signal = ExitSignal(t.exit_signal_handler, device())
        self._info(f"training iterations {self.iteration + 1}..{t.train_iters}: global batch {t.global_batch_size} "
                   f"= micro batch {t.micro_batch_size} × DP {self.dp_size} × {self.num_microbatches} micro batches, "
                   f"seq {cfg.model.seq_length}")
        bar = tqdm(total=t.train_iters, initial=self.iteration, desc="train", unit="step",
                   disable=self.rank != 0 or not sys.stderr.isatty(), dynamic_ncols=True)
        self.reruns.resume(cfg.checkpoint.save, self.iteration, log_dir(cfg))
        self.watchdog.start(self.iteration)
        self.goodput.spent("startup")
        while self.iteration < t.train_iters:
            self.where = f"iteration {self.iteration + 1}"
            if self.graphs.before_step(self.iteration):
                self._info(f"CUDA graphs: TransformerEngine captured the decoder layers before iteration "
                           f"{self.iteration + 1}")
            start = time.perf_counter()
            with self.profiler.step(self.iteration + 1):
                # the wait for each batch counts as the step's data time
                updated = self.train_step(self.data.training_batches(self.metrics.timers.timed_batches))
            if self.reruns.elsewhere:
                self._stop_to_rerun_elsewhere(result)
            self.iteration += 1
            self.data.step_done(self.iteration)
            if updated:
                self.metrics.step_done()
                self.pending.took(time.perf_counter() - start)
            else:  # a skipped step's time is not a training step's
                self.metrics.discard()
            stop = bool(t.exit_interval and self.iteration % t.exit_interval == 0)
            signalled = clock_due = rewound = False
            if self._settles(stop, first=not result.startup):  # the same decision on every rank
                # signals and rank 0's clock (which alone decides a time-based save) are agreed where the loop
                # reads the device anyway
                signalled, clock_due = exit_signal.agree(self.rank == 0 and self.checkpointer.save_due_by_clock())
                stop = stop or signalled
                rewound = self._settle(result)
                self.checkpointer.finish_completed_writes()
                if result.train_losses:
                    bar.set_postfix(loss=f"{result.train_losses[max(result.train_losses)]:.3f}")
            if not result.startup:
                self.startup.mark("first step" + (" (compiling the decoder layers)" if cfg.train.compile else
                                                  " (capturing CUDA graphs)" if cfg.train.cuda_graph_impl == "local"
                                                  else ""))
                result.startup = self.startup.summary()  # the first step was settled: its time is the device's
                self._info(f"start-up: {result.startup}")
                if cfg.train.offload_modules:
                    self._info(activation_offload.describe())
                if self.restart:
                    timed = (self.startup.start, self.startup.phases)  # from the attempt's start to now
                    self.run_logger.restart(self.iteration, self.restart.describe(*timed),
                                            self.restart.scalars(*timed))
            if rewound:  # the step boundary of the checkpoint's iteration has been passed already
                bar.n = self.iteration
                self.watchdog.step_done(self.iteration)
                continue
            bar.update(1)
            self.watchdog.step_done(self.iteration)
            self.progress.step_done(self.iteration)
            self.goodput.step_done(self.iteration)
            self._evaluate_if_due(result)
            raise_if_launcher_gone()  # an orphan must not save
            result.checkpoint = self._checkpoint(stopping=stop, clock_due=clock_due) or result.checkpoint
            if stop:
                self._info(f"stopped cleanly after iteration {self.iteration} "
                           f"({'exit signal' if signalled else 'train.exit_interval'})")
                result.stopped_early, result.stopped_by_signal = True, signalled
                break
        self.watchdog.close()
        self.profiler.close()
        self.graphs.close()
        bar.close()
        reruns = self.reruns.summary()
        if reruns:
            self._info(reruns)
        self.reruns.close()
        if t.train_iters == 0:  # a run of 0 steps saves the initial weights
            result.checkpoint = self._checkpoint(stopping=False)
        self.checkpointer.close()  # the last checkpoint is complete before the run reports it
        self.goodput.spent("checkpoint")
        in_flight = stop_data_parallel_communication(self.model)
        if in_flight:
            self._info(f"Megatron-FSDP: waited for the {in_flight} parameter all-gathers still in flight after the last "
                       "step before the process groups close")
        result.iteration = self.iteration
        result.plan_check = self.metrics.plan_check()
        self.goodput.spent("other")
        self.goodput.write()
        result.goodput = self.goodput.ledger
        self.run_logger.goodput(self.iteration, self.goodput.ledger)
        self.run_logger.close()
        return result


def pretrain(cfg: RecipeConfig, startup: Optional[StartupClock] = None) -> RunResult:
    """Train `cfg` on this process's rank; collective over all ranks started by torchrun. `startup` has timed what
    came before (imports, checks)."""
    trainer = None
    try:
        trainer = Trainer(cfg, startup)
        return trainer.train()
    except BaseException as exc:
        if trainer is not None:
            trainer.watchdog.close()  # a slow teardown is not a hang
            trainer.checkpointer.abort()  # its writer process would otherwise keep the rank from exiting
            trainer.run_logger.close(failed=True)  # what was logged survives the fast exit
        where = trainer.where if trainer is not None else "start-up"
        advice = _out_of_memory_advice(cfg) if isinstance(exc, torch.OutOfMemoryError) else ""
        raise RunFailed(report_failure(exc, int(os.environ.get("RANK", "0")), where, log_dir(cfg), advice)) from exc
    finally:
        destroy_distributed()


def _out_of_memory_advice(cfg: RecipeConfig) -> str:
    stage = parallel_state.get_pipeline_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return out_of_memory_advice(cfg, stage, dist.get_world_size() if dist.is_initialized() else 1, device_bytes)
