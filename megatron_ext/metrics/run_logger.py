"""Throughput accounting and run logging: FLOPs/MFU, the per-step console line, TensorBoard (and W&B) scalars.

Model FLOPs per token, as current Megatron-LM counts them (``num_floating_point_operations``):
``6·N + 6·L·q·s`` where N counts every matmul weight (attention, MLP and output layer; not the input
embedding, a lookup, nor the norms), L layers, q the query width (heads × head dim, h for Llama), s the
sequence length. The attention term is the two score matmuls (QKᵀ and ·V, 2 FLOPs per multiply-add, ×3
for forward + backward) over the **causal half** of the s×s score matrix, the only half a causal kernel
computes. ``causal=False`` gives the older PaLM-style count of the full matrix (``12·L·q·s``), ~10 %
higher MFU at seq 4096 for a 1B model and ~25 % at 16384; the benchmark JSON records both.
MFU = achieved / peak dense BF16.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import os
import statistics
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Literal, Optional

import torch

from megatron_ext.config.paths import is_object_storage
from megatron_ext.config.schema import RecipeConfig, log_dir
from megatron_ext.config.shape import model_flops_per_token
from megatron_ext.hardware import peak_bf16_tflops
from megatron_ext.metrics.goodput_ledger import Ledger
from megatron_ext.metrics.step_time import PARTS
from megatron_ext.metrics.units import format_duration
from megatron_ext.resilience.elastic import RESTART_DECIDED_AT
from megatron_ext.resilience.spikes import Spike
from megatron_ext.resilience.stragglers import Straggler, spread_scalars, warn_stragglers

log = logging.getLogger("megatron_ext")


def peak_tflops(cfg: RecipeConfig) -> Optional[float]:
    """Peak dense BF16 TFLOP/s of this GPU: the config's override, else the table; None on CPU."""
    if cfg.logging.gpu_peak_tflops:
        return cfg.logging.gpu_peak_tflops
    if not torch.cuda.is_available():
        return None
    return peak_bf16_tflops(torch.cuda.get_device_name())


def gpu_scalars() -> dict[str, float]:
    """This GPU's memory (allocated, reserved, peak allocated) and, where NVML answers, utilisation and power."""
    scalars = {"perf/mem_allocated_gib": torch.cuda.memory_allocated() / 2**30,
               "perf/mem_reserved_gib": torch.cuda.memory_reserved() / 2**30,
               "perf/mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    try:  # torch asks NVML (the pynvml / nvidia-ml-py package); absent or unsupported, these two are left out
        scalars["perf/gpu_util_pct"] = float(torch.cuda.utilization())
        scalars["perf/gpu_power_w"] = torch.cuda.power_draw() / 1000.0
    except (ModuleNotFoundError, RuntimeError, AttributeError):
        pass
    return scalars


def breakdown_scalars(breakdown: dict[str, float]) -> dict[str, float]:
    """time/<part>_s per step, and time/other_s: what the parts leave of the step (Python between regions)."""
    parts = {f"time/{part}_s": seconds for part, seconds in breakdown.items() if part in PARTS}
    return {**parts, "time/other_s": breakdown["step"] - sum(parts.values())}


def breakdown_shares(breakdown: dict[str, float]) -> dict[str, float]:
    """Each part's share of the step, `other` included."""
    return {name.removeprefix("time/").removesuffix("_s"): seconds / breakdown["step"]
            for name, seconds in breakdown_scalars(breakdown).items()}


def _console_name(tag: str) -> str:
    """A model-wide extra scalar's name on the console line: an MoE one without its section (``moe/load_cv`` → load
    cv), others with it (``mtp/loss_1`` → mtp loss 1)."""
    return (tag.split("/", 1)[1] if tag.startswith("moe/") else tag.replace("/", " ")).replace("_", " ")


def perplexity(loss: float) -> float:
    """exp(loss), capped where a diverged loss would overflow it."""
    return math.exp(min(loss, 50.0))


def process_start_time(pid: int | Literal["self"] = "self") -> float:
    """When this process (or `pid`) started (seconds since the epoch), to the kernel's clock tick. psutil's
    create_time adds the tick count to a boot time rounded to the second, which moved every start-up phase by up to
    a second (0.5 s measured)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    except (OSError, IndexError, ValueError):  # not Linux
        import psutil

        return psutil.Process(None if pid == "self" else pid).create_time()
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return booted + ticks / os.sysconf("SC_CLK_TCK")


def launcher_start_time() -> Optional[float]:
    """When the launcher of this attempt started: an elastic agent (torchrun, recipes.launch, NVRx's ft_launcher, the
    suite's fork launcher) starts its workers as its children with TORCHELASTIC_RUN_ID set, so on their first start
    it is the parent's start. None without an agent, and on a restart by one (it started before the attempt)."""
    if ("TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
            or RESTART_DECIDED_AT in os.environ):
        return None
    return process_start_time(os.getppid())


class StartupClock:
    """Where the time to the first step goes: each start-up phase's seconds, from the attempt's start (the launcher's,
    see :func:`launcher_start_time`, or the process's: its imports) to the end of the first training step."""

    def __init__(self, since: Optional[float] = None):
        self.start = self.last = since if since is not None else time.time()
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str, at: Optional[float] = None) -> None:
        """`phase` ended now, or `at` (it began where the previous one ended)."""
        now = time.time() if at is None else at
        self.phases.append((phase, now - self.last))
        self.last = now

    def not_before(self, moment: float) -> None:
        """This attempt follows another whose last step was at `moment`: a launcher that started before it (a spare
        agent, waiting to join until a node was lost) is no part of this attempt's start-up, which then starts with
        its process."""
        if self.phases and self.phases[0][0] == "launcher" and self.start < moment:
            self.start += self.phases.pop(0)[1]

    def summary(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phases)
        return f"{self.last - self.start:.1f} s to the end of the first step: {parts}"


class TimeLeft:
    """The time to train.train_iters from the median of the recent steps (robust to a slow first step, an
    evaluation or a checkpoint save landing in the window)."""

    def __init__(self, train_iters: int, window: int = 20):
        self.train_iters = train_iters
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, step_time: float) -> None:
        self.recent.append(step_time)

    def seconds(self, iteration: int) -> float:
        return statistics.median(self.recent) * max(self.train_iters - iteration, 0) if self.recent else 0.0


def _start_wandb(cfg: RecipeConfig):
    """A W&B run with the resolved config, in the run directory. Its id comes from the checkpoint directory (else the
    recipe name), so a relaunch that resumes the training run appends to the same W&B run."""
    import wandb

    g = cfg.logging
    save = cfg.checkpoint.save
    # the checkpoint directory wherever the relaunch starts from (an object-storage location is absolute already)
    identity = (save if is_object_storage(save) else str(Path(save).resolve())) if save else cfg.recipe.name
    run_dir = Path(log_dir(cfg)).parent
    run_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=g.wandb_project, entity=g.wandb_entity, name=g.wandb_run_name or cfg.recipe.name,
                      id=hashlib.sha1(identity.encode()).hexdigest()[:16], resume="allow", config=cfg.to_dict(),
                      dir=str(run_dir))


class RunLogger:
    """Rank-0 console lines and TensorBoard scalars; the TensorBoard step is the training iteration."""

    def __init__(self, cfg: RecipeConfig, vocab_size: int, world_size: int, enabled: bool):
        self.enabled = enabled
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.train_iters = cfg.train.train_iters
        self.time_left = TimeLeft(cfg.train.train_iters)
        self.flops_per_step = model_flops_per_token(cfg, vocab_size) * self.tokens_per_step
        # torchtitan's (and PaLM's) count, for comparing with their MFU: the whole s×s score matrix
        self.full_attention_flops_per_step = model_flops_per_token(cfg, vocab_size, causal=False) * self.tokens_per_step
        self.world_size = world_size
        self.peak = peak_tflops(cfg)
        self.straggler_factor, self.straggler_intervals = cfg.logging.straggler_factor, cfg.logging.straggler_intervals
        self.writer = None
        if enabled and cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=cfg.logging.tensorboard_dir)
        self.wandb = _start_wandb(cfg) if enabled and cfg.logging.wandb_project else None

    def step(self, iteration: int, loss: float, lr: float, grad_norm: float, step_time: float,
             console: bool, rank_times: Optional[list[float]] = None,
             breakdown: Optional[dict[str, float]] = None, loss_scale: Optional[float] = None,
             extra: Optional[dict[str, float]] = None) -> dict[str, float]:
        """One step's scalars; `rank_times`, each rank's compute per step over the last log interval, adds their
        spread (perf/step_time_{min,max}_s, perf/slowest_rank) to TensorBoard and the console line; `breakdown`,
        the ranks' mean seconds per step in each part of the step over that interval (metrics.step_time), adds
        time/<part>_s and time/other_s (the rest of the step) and the parts' shares to the console line; `loss_scale`
        (fp16) adds train/loss_scale; `extra` (an MoE model's moe/… scalars, multi-token prediction's mtp/loss_k) goes
        to TensorBoard, and its model-wide ones (not moe/layer<i>/<name>) to the console line."""
        self.time_left.add(step_time)
        scalars = {
            "train/lm_loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_per_sec": self.tokens_per_step / step_time,
            # what Megatron-Bridge and torchtitan report
            "train/tokens_per_sec_per_gpu": self.tokens_per_step / step_time / self.world_size,
            "train/step_time_s": step_time,
            "progress/fraction_done": iteration / max(self.train_iters, 1),
            "progress/hours_left": self.time_left.seconds(iteration) / 3600,
        }
        if loss_scale is not None:
            scalars["train/loss_scale"] = loss_scale
        scalars.update(extra or {})
        if torch.cuda.is_available():
            tflops = self.flops_per_step / step_time / self.world_size / 1e12
            scalars["train/tflops_per_gpu"] = tflops
            if self.peak:
                scalars["train/mfu"] = tflops / self.peak
                scalars["train/mfu_full_attention"] = (self.full_attention_flops_per_step / step_time /
                                                       self.world_size / 1e12 / self.peak)
            if self.enabled:
                scalars.update(gpu_scalars())
        if rank_times:
            scalars.update(spread_scalars(rank_times))
        shares = breakdown_shares(breakdown) if breakdown else None
        if breakdown:
            scalars.update(breakdown_scalars(breakdown))
        if not self.enabled:
            return scalars
        self._write(scalars, iteration)
        if console:
            line = (f"step {iteration:>6,}/{self.train_iters:,} | loss {loss:.4f} | lr {lr:.3e} | "
                    f"grad-norm {grad_norm:.3f} | "
                    + (f"loss scale {loss_scale:,.0f} | " if loss_scale is not None else "")
                    + "".join(f"{_console_name(tag)} {value:.4f} | "
                              for tag, value in (extra or {}).items() if tag.count("/") == 1) +
                    f"{scalars['train/tokens_per_sec']:,.0f} tok/s ({scalars['train/tokens_per_sec_per_gpu']:,.0f} "
                    f"per {'GPU' if torch.cuda.is_available() else 'process'}) | {step_time * 1000:.0f} ms")
            if "train/tflops_per_gpu" in scalars:
                line += f" | {scalars['train/tflops_per_gpu']:.1f} TFLOP/s/GPU"
                if "train/mfu" in scalars:
                    line += f" | MFU {100 * scalars['train/mfu']:.1f}%"
                line += f" | mem {scalars['perf/mem_peak_gib']:.1f} GiB"
            if rank_times and len(rank_times) > 1:
                line += (f" | compute {scalars['perf/step_time_min_s'] * 1000:.0f}-"
                         f"{scalars['perf/step_time_max_s'] * 1000:.0f} ms (slowest rank "
                         f"{scalars['perf/slowest_rank']:.0f})")
            if shares:
                line += " | " + " ".join(f"{part.replace('_', ' ')} {100 * share:.0f}%"
                                         for part, share in shares.items() if round(100 * share))
            if iteration < self.train_iters:
                line += f" | {format_duration(self.time_left.seconds(iteration))} left"
            log.info(line)
        return scalars

    def advice(self, lines: list[str]) -> None:
        """Bottleneck advice (metrics.advice), each on its own line."""
        if self.enabled:
            for line in lines:
                log.info(f"advice: {line}")

    def evaluation(self, split: Literal["val", "test"], iteration: int, loss: float) -> None:
        """A validation (every train.eval_interval) or test (after the last step) loss, and its perplexity."""
        if self.enabled:
            ppl = perplexity(loss)
            self._write({f"{split}/lm_loss": loss, f"{split}/ppl": ppl}, iteration)
            name = "validation" if split == "val" else "test split"
            log.info(f"{name} at step {iteration}: loss {loss:.4f} | perplexity {ppl:,.2f}")

    def loss_spike(self, spike: Spike, action: str = "", rewinds: Optional[int] = None) -> None:
        """A loss spike (resilience.spikes): one warning naming the step's samples and what the run did about it
        (`action`: skipped, rewound), and `train/loss_spike` (its deviations), `train/spike_skipped` or
        `train/rewinds` (how many so far)."""
        if not self.enabled:
            return
        scalars = {"train/loss_spike": spike.deviations}
        if rewinds is not None:
            scalars["train/rewinds"] = float(rewinds)
        elif action:
            scalars["train/spike_skipped"] = 1.0
        self._write(scalars, spike.iteration)
        log.warning(spike.describe() + (f"; {action}" if action else ""))

    def stragglers(self, iteration: int, named: list[Straggler]) -> None:
        """Warn about the ranks the straggler detector named."""
        if self.enabled:
            warn_stragglers(named, self.straggler_factor, self.straggler_intervals, iteration,
                            torch.cuda.is_available())

    def overflow(self, iteration: int, before: float, after: float) -> None:
        """fp16: the grad scaler skipped this step's update (an overflow) and the scale went from `before` to `after`
        (it halves after train.hysteresis overflows)."""
        if self.enabled:
            self._write({"train/loss_scale": after, "train/overflow_skipped": 1.0}, iteration)
            scale = (f"loss scale {before:,.0f} -> {after:,.0f}" if after != before else
                     f"loss scale stays {after:,.0f} (it halves after train.hysteresis overflows)")
            log.info(f"fp16 overflow at iteration {iteration}: step skipped, {scale}")

    def transient_faults(self, iteration: int, total: int) -> None:
        """train.rerun_mode=validate_results healed a step (resilience.reruns): `train/transient_faults`, how many so
        far (the ranks that saw them say so themselves)."""
        if self.enabled:
            self._write({"train/transient_faults": float(total)}, iteration)

    def restart(self, iteration: int, line: str, scalars: dict[str, float]) -> None:
        """What a restart changed and cost (resilience.elastic), once, at the first step after it."""
        if self.enabled:
            self._write(scalars, iteration)
            log.info(line)

    def checkpoint_stall(self, iteration: int, seconds: float) -> None:
        """How long a checkpoint save held training up (the whole write, or its start when asynchronous)."""
        if self.enabled:
            self._write({"checkpoint/stall_s": seconds}, iteration)

    def goodput(self, iteration: int, ledger: Ledger) -> None:
        """The goodput ledger's shares (`goodput/productive` is the goodput) and its wall-clock, at a checkpoint save
        and the end."""
        if self.enabled:
            self._write({**{f"goodput/{bucket}": share for bucket, share in ledger.fractions().items()},
                         "goodput/wall_clock_h": ledger.total / 3600}, iteration)

    def _write(self, scalars: dict[str, float], iteration: int) -> None:
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, iteration)
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)

    def close(self, failed: bool = False) -> None:
        """Everything logged onto disk (a failing rank exits without the interpreter's teardown, which would have
        finished the W&B run)."""
        try:
            if self.writer is not None:
                self.writer.close()
            if self.wandb is not None:
                self.wandb.finish(exit_code=1 if failed else 0)
        except OSError as e:  # a full disk must not hide the failure being reported, nor crash a finished run
            log.warning(f"TensorBoard/W&B could not write their last records ({type(e).__name__}: {e})")


# The temporary directories wandb (0.31) makes when it is imported: (module, attribute path) of each.
_WANDB_IMPORT_TEMP_DIRS = (("wandb.sdk.data_types._private", "MEDIA_TMP"),
                           ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR"))


def remove_wandb_import_temp_dirs() -> None:
    """Remove the two temporary directories wandb makes when it is imported (every rank of a run that logs to W&B
    imports it), which wandb leaves to finalizers at interpreter exit, which a rank that ends with ``os._exit``
    skips (recipes/pretrain.py): without this every rank of every such launch leaves two behind in the temporary
    directory. tests/integration/test_wandb.py checks that a run leaves none."""
    for module_name, attributes in _WANDB_IMPORT_TEMP_DIRS:
        holder = sys.modules.get(module_name)
        for attribute in attributes.split("."):
            holder = getattr(holder, attribute, None)
        if holder is not None:
            with suppress(OSError):  # a process forked from one that removed them already
                holder.cleanup()


def read_scalars(tensorboard_dir: str | Path, tag: str) -> dict[int, float]:
    """{step: value} of one scalar tag, across every event file in the directory (resumed runs append);
    empty when nothing logged it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return {}
    return {event.step: event.value for event in acc.Scalars(tag)}
