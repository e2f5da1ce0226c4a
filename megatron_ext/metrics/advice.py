"""Bottleneck advice: rules over the time breakdown (metrics.step_time, mean over ranks; the gradient sync's least
over ranks, the wait of the last rank to arrive) and memory, each said once
per run with the setting to change and what the planner expects it to gain. Thresholds, from the usage targets
(communication under 20 % of the step, the GPU busy over 80 %): pipeline waits above 15 % of the step, exposed
gradient sync above 10 %, data waits above 5 %, and on a GPU more than 30 % of its memory unused at the peak. A rule
is judged on the mean of the last ``WINDOW`` log intervals (two at least, the first interval left out: it holds the
first step), so one noisy interval neither raises nor hides it.

Pipeline waits have two causes that want different fixes: the bubble ((p−1)/(v·m) of the compute, fixed by more micro
batches or interleaving) and unbalanced stages (the others wait for the slowest, typically the last, which also runs
the output layer and the loss; fixed by moving layers off it). The per-stage compute tells them apart.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from megatron_ext.config.schema import (
    RecipeConfig,
    data_parallel_size,
    microbatches_per_step,
    pipeline_stage_layers,
)
from megatron_ext.hardware import GPUS
from megatron_ext.metrics.units import format_duration
from megatron_ext.planner import GIB, estimate, model_vocab_size
from megatron_ext.planner.goodput import CheckpointInterval, expected_goodput

# The share of the step (of the GPU's memory, for "memory": unused at the peak) above which each rule speaks.
THRESHOLDS = {"pipeline": 0.15, "grad_sync": 0.10, "data": 0.05, "memory": 0.30}
IMBALANCE = 1.25  # slowest over fastest stage compute above which stages count as unbalanced
WINDOW = 4
# A configured checkpoint interval is advised against when it costs more expected goodput than this against the best
INTERVAL_GOODPUT_POINTS = 0.03


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where the planner's estimates of a gain are made: its GPU table key, and the job's ranks per node (None
    where the planner has no entry for the GPU: the advice then comes without estimates)."""

    gpu: str
    gpus_per_node: int


def stage_imbalance(cfg: RecipeConfig, stage_compute: dict[int, float]) -> Optional[str]:
    """A sentence when the stages' compute per step differs by more than IMBALANCE, with the layers to move off the
    last stage when that is the slow one and moving them helps."""
    if len(stage_compute) < 2 or min(stage_compute.values()) <= 0:
        return None
    slow, fast = max(stage_compute, key=stage_compute.get), min(stage_compute, key=stage_compute.get)
    ratio = stage_compute[slow] / stage_compute[fast]
    if ratio <= IMBALANCE:
        return None
    text = (f"pipeline stages are unbalanced: stage {slow} computes {ratio:.1f}× stage {fast} per step, and the "
            f"others wait for it")
    pp, layers = len(stage_compute), pipeline_stage_layers(cfg)
    if slow != pp - 1:
        return text
    per_layer = sum(stage_compute[s] for s in range(pp - 1)) / sum(layers[:-1])
    extra = stage_compute[slow] - layers[-1] * per_layer  # the output layer and the loss, in seconds
    text += f"; the last stage also runs the output layer and the loss, about {extra / per_layer:.1f} layers' worth"
    # k layers off the last stage, spread evenly over the others: balanced when extra = k·per_layer·pp/(pp−1)
    k = round(extra / (per_layer * pp)) * (pp - 1)  # in whole layers for each of the other stages
    if k >= 1 and layers[-1] - k >= 1:
        after = max((layers[-1] - k) * per_layer + extra, (layers[0] + k / (pp - 1)) * per_layer)
        if after < stage_compute[slow]:
            text += (f": parallel.num_layers_in_last_pipeline_stage={layers[-1] - k} moves {k} off it "
                     f"(about {100 * (stage_compute[slow] / after - 1):.0f}% faster steps)")
    return text


def _gain(before_s: float, after_s: float) -> str:
    return f"{100 * (before_s / after_s - 1):+.0f}% tokens/s"


def _with(cfg: RecipeConfig, parallel: Optional[dict] = None, train: Optional[dict] = None) -> RecipeConfig:
    """`cfg` with some parallel.* and train.* values changed: the what-if the planner estimates."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **(parallel or {})),
                               train=dataclasses.replace(cfg.train, **(train or {})))


def _pipeline(cfg: RecipeConfig, world_size: int, share: float, stage_compute: dict[int, float]) -> str:
    p, t = cfg.parallel, cfg.train
    pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    m = microbatches_per_step(cfg, world_size)
    bubble = (pp - 1) / (v * m)
    text = f"pipeline sends, receives and waits take {100 * share:.0f}% of the step (above " \
           f"{100 * THRESHOLDS['pipeline']:.0f}%)"
    imbalance = stage_imbalance(cfg, stage_compute)
    if imbalance:
        text += f": {imbalance}"
    if bubble > THRESHOLDS["pipeline"] or not imbalance:
        text += (f"{'; and' if imbalance else ':'} the bubble is (PP−1)/(VPP·m) = {pp - 1}/({v}·{m}) = {bubble:.2f} "
                 f"of the compute: m = {2 * m} micro batches per pipeline (train.global_batch_size="
                 f"{2 * t.global_batch_size}) makes it {bubble / 2:.2f}, {_gain(1 + bubble, 1 + bubble / 2)} "
                 f"(planner)")
        if v == 1:
            text += ", and interleaving (parallel.virtual_pipeline_model_parallel_size=2) halves it too"
    return text


def _grad_sync(cfg: RecipeConfig, world_size: int, share: float, machine: Optional[Machine]) -> str:
    text = (f"exposed gradient sync takes {100 * share:.0f}% of the step (above "
            f"{100 * THRESHOLDS['grad_sync']:.0f}%): ")
    if cfg.parallel.overlap_grad_reduce:
        return text + "a larger global batch per DP rank (more backward pass to hide it behind), or less DP"
    distopt = cfg.parallel.use_distributed_optimizer
    fix = (f"parallel.overlap_grad_reduce=true{' and parallel.overlap_param_gather=true' if distopt else ''} "
           f"hide it behind the backward pass")
    if machine is None:
        return text + fix
    vocab, spec = model_vocab_size(cfg), GPUS[machine.gpu]
    overlap = {on: _with(cfg, parallel={"overlap_grad_reduce": on, "overlap_param_gather": on and distopt})
               for on in (False, True)}
    exposed = {on: estimate(what_if, world_size, machine.gpus_per_node, spec, vocab).time["dp_comm"]
               for on, what_if in overlap.items()}
    hidden = 1 - exposed[True] / exposed[False] if exposed[False] else 0.0
    return text + (f"{fix} — the planner expects {100 * hidden:.0f}% of it hidden on {machine.gpu}, "
                   f"{_gain(1, 1 - share * hidden)}")


def _memory(cfg: RecipeConfig, world_size: int, used: float, machine: Optional[Machine]) -> str:
    t = cfg.train
    text = f"the peak uses {100 * used:.0f}% of the GPU's memory: "
    dp = data_parallel_size(cfg, world_size)
    options = []
    if t.global_batch_size % (2 * t.micro_batch_size * dp) == 0:
        options.append(_with(cfg, train={"micro_batch_size": 2 * t.micro_batch_size}))
    if t.recompute_granularity:
        options.append(_with(cfg, train={"recompute_granularity": None}))
    if machine is None:
        return text + "a larger train.micro_batch_size or less recompute would use the rest"
    vocab, spec = model_vocab_size(cfg), GPUS[machine.gpu]
    now = estimate(cfg, world_size, machine.gpus_per_node, spec, vocab)
    said = []
    for option in options:
        e = estimate(option, world_size, machine.gpus_per_node, spec, vocab)
        change = (f"train.micro_batch_size={option.train.micro_batch_size}" if option.train.micro_batch_size !=
                  t.micro_batch_size else f"train.recompute_granularity=null (now {t.recompute_granularity})")
        fits = "fits" if e.fits else "does not fit"
        said.append(f"{change}: the planner estimates {e.memory['total'] / GIB:.1f} GiB ({fits}), "
                    f"{_gain(now.time['step'], e.time['step'])}")
    return text + ("; ".join(said) if said else "use the rest with a longer sequence or fewer GPUs for the model "
                   "(python -m recipes.plan)")


def exposed_grad_sync_share(ranks: list[dict[str, float]]) -> float:
    """The gradient sync left exposed, as a share of the mean step over `ranks` (each rank's seconds per part and
    "step"): the least over ranks. A rank done with its backward pass first waits in the sync for the slowest one —
    straggling, which the straggler check reports and more overlap does not fix; the last to arrive waits only for the
    communication."""
    return min(rank["grad_sync"] for rank in ranks) / (sum(rank["step"] for rank in ranks) / len(ranks))


def advise(cfg: RecipeConfig, world_size: int, shares: dict[str, float], machine: Optional[Machine],
           memory_used: Optional[float] = None, stage_compute: Optional[dict[int, float]] = None) -> dict[str, str]:
    """{rule: advice} for the rules these shares break. `shares`: each part's fraction of the step; `memory_used`:
    the peak allocated fraction of the GPU's memory on the fullest rank (None on CPU); `stage_compute`: each pipeline
    stage's compute seconds per step."""
    out = {}
    share = shares.get("pipeline", 0.0)
    if share > THRESHOLDS["pipeline"] and cfg.parallel.pipeline_model_parallel_size > 1:
        out["pipeline"] = _pipeline(cfg, world_size, share, stage_compute or {})
    share = shares.get("grad_sync", 0.0)
    if share > THRESHOLDS["grad_sync"]:
        out["grad_sync"] = _grad_sync(cfg, world_size, share, machine)
    share = shares.get("data", 0.0)
    if share > THRESHOLDS["data"]:
        out["data"] = (f"waiting for data takes {100 * share:.0f}% of the step (above "
                       f"{100 * THRESHOLDS['data']:.0f}%): data.num_workers={max(2, 2 * cfg.data.num_workers)} "
                       f"loads batches in the background, up to {_gain(1, 1 - share)}; check the storage's read "
                       f"speed")
    if memory_used is not None and 1 - memory_used > THRESHOLDS["memory"]:
        out["memory"] = _memory(cfg, world_size, memory_used, machine)
    return out


class Advisor:
    """Says each rule's advice once per run, judged on the mean of the last WINDOW log intervals after the first."""

    def __init__(self, cfg: RecipeConfig, world_size: int, machine: Optional[Machine]):
        self.cfg, self.world_size, self.machine = cfg, world_size, machine
        self.said: set[str] = set()
        self.intervals = 0
        self.recent: collections.deque[dict[str, float]] = collections.deque(maxlen=WINDOW)

    def check(self, shares: dict[str, float], memory_used: Optional[float] = None,
              stage_compute: Optional[dict[int, float]] = None) -> list[str]:
        self.intervals += 1
        if self.intervals == 1:
            return []
        self.recent.append(shares)
        if len(self.recent) < 2:
            return []
        mean = {part: sum(s.get(part, 0.0) for s in self.recent) / len(self.recent)
                for part in set().union(*self.recent)}
        new = {rule: text for rule, text in advise(self.cfg, self.world_size, mean, self.machine, memory_used,
                                                   stage_compute).items() if rule not in self.said}
        self.said.update(new)
        return list(new.values())


def checkpoint_interval_advice(i: CheckpointInterval, train_iters: int) -> Optional[str]:
    """One line at start-up when the run's checkpoint.save_interval (unset: a save at the end only) costs more than
    INTERVAL_GOODPUT_POINTS of expected goodput against the planner's interval; None otherwise."""
    steps = min(i.configured_steps or train_iters, train_iters)
    step_s = i.interval_s / i.steps
    configured = expected_goodput(steps * step_s, i.stall_s, i.mtbf_s, i.restart_s, i.background_write_s)
    if i.goodput - configured <= INTERVAL_GOODPUT_POINTS:
        return None
    now = (f"checkpoint.save_interval={i.configured_steps}" if i.configured_steps
           else "saving only at the end (checkpoint.save_interval unset)")
    return (f"{now} gives an expected goodput of {100 * configured:.1f} %, against {100 * i.goodput:.1f} % with a "
            f"save every {i.steps:,} steps ({format_duration(i.interval_s)}) for this job's planned "
            f"{step_s:,.1f} s steps and MTBF of {format_duration(i.mtbf_s)}: set checkpoint.save_interval={i.steps} "
            "(python -m recipes.plan shows how it is derived)")
