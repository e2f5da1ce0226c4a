"""Throughput accounting: the FLOPs formula (config.shape) against a hand count, the MFU peak table (hardware); the
run log's time-left, start-up clock, step timers, bottleneck advice and the breakdown set beside the planner's."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_ext.config.schema import load_config
from megatron_ext.config.shape import ModelShape
from megatron_ext.hardware import GPUS, PEAK_BF16_TFLOPS, peak_bf16_tflops
from tests.launch import ROOT, TINY


def flops_per_token(cfg, vocab_size: int, causal: bool = True) -> float:
    return ModelShape.of(cfg.model).flops_per_token(vocab_size, causal)


def small(*overrides: str):
    return load_config(TINY, ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                              "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.seq_length=16",
                              *overrides])


def test_flops_per_token_matches_a_hand_count():
    # per layer: q 64·64 + k,v 2·(64·32) + o 64·64 + SwiGLU 3·64·128 = 36,864 matmul weights;
    # 2 layers + output layer 100·64 = 80,128. Attention per token: QKᵀ and ·V over s keys, 2 FLOPs per
    # multiply-add, ×3 for forward + backward = 12·L·q·s = 12·2·64·16 = 24,576 for the whole score matrix,
    # half of it causal (Megatron-LM's count).
    assert flops_per_token(small(), vocab_size=100) == 6 * 80_128 + 24_576 / 2
    assert flops_per_token(small(), vocab_size=100, causal=False) == 6 * 80_128 + 24_576


def test_tied_output_layer_still_counts_as_a_matmul():
    untied = flops_per_token(small(), vocab_size=100)
    tied = flops_per_token(small("model.untie_embeddings_and_output_weights=false"), vocab_size=100)
    assert tied == untied


def test_flops_scale_with_sequence_only_through_attention():
    short, long = (flops_per_token(small(f"model.seq_length={s}"), 100) for s in (16, 32))
    assert long - short == 6 * 2 * 64 * 16


def test_peak_table_has_the_gpus_the_docs_name():
    assert PEAK_BF16_TFLOPS["H100"] == 989.0 and PEAK_BF16_TFLOPS["H200"] == 989.0
    assert PEAK_BF16_TFLOPS["A100"] == 312.0


def test_a_device_name_finds_its_own_family_and_the_planner_shares_the_peaks():
    assert peak_bf16_tflops("NVIDIA GB200") == 2500.0 and peak_bf16_tflops("NVIDIA B200") == 2250.0
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_bf16_tflops("Tesla T4") is None
    assert {spec.peak_bf16_tflops for spec in GPUS.values()} <= set(PEAK_BF16_TFLOPS.values())


def test_time_left_is_the_recent_median_step_times_the_steps_to_go():
    from megatron_ext.metrics.run_logger import TimeLeft
    from megatron_ext.metrics.units import format_duration

    left = TimeLeft(train_iters=50_000, window=3)
    for step_time in (30.0, 3.0, 3.2, 3.1):  # the slow first step has left the window
        left.add(step_time)
    assert left.seconds(1_200) == 3.1 * 48_800
    assert format_duration(left.seconds(1_200)) == "1 d 18 h"
    assert [format_duration(s) for s in (0, 12.4, 250, 3 * 3600 + 12 * 60 + 5, 2 * 86400 + 3 * 3600 + 59)] == \
        ["0 s", "12 s", "4 min 10 s", "3 h 12 min", "2 d 3 h"]
    assert TimeLeft(10).seconds(0) == 0.0 and left.seconds(60_000) == 0.0


def test_the_startup_clock_splits_the_time_to_the_first_step_into_its_phases(monkeypatch):
    from megatron_ext.metrics import run_logger

    now = iter([100.0, 102.5, 103.0, 110.0])
    monkeypatch.setattr(run_logger.time, "time", lambda: next(now))
    clock = run_logger.StartupClock(since=98.0)
    for phase in ("imports", "process groups", "model and optimizer", "first step"):
        clock.mark(phase)
    assert clock.summary() == ("12.0 s to the end of the first step: imports 2.0 s, process groups 2.5 s, "
                               "model and optimizer 0.5 s, first step 7.0 s")


def test_a_spare_agents_launcher_is_no_part_of_the_attempt_after_a_lost_node(monkeypatch):
    """On a restart, a launcher phase that began before the previous attempt's last step (a spare agent waiting to
    join) is dropped: the attempt starts with its process."""
    from megatron_ext.metrics import run_logger

    now = iter([100.0, 101.0])
    monkeypatch.setattr(run_logger.time, "time", lambda: next(now))
    clock = run_logger.StartupClock(since=40.0)
    clock.mark("launcher", at=97.0)
    clock.mark("imports")
    clock.not_before(90.0)  # the previous attempt's last step
    assert (clock.start, clock.phases) == (97.0, [("imports", 3.0)])
    requeued = run_logger.StartupClock(since=95.0)
    requeued.mark("launcher", at=97.0)
    requeued.not_before(90.0)  # a requeue's launcher started after it: its phase is part of the recovery
    assert (requeued.start, requeued.phases) == (95.0, [("launcher", 2.0)])

def test_the_launchers_start_counts_on_a_first_start_by_an_elastic_agent_only(monkeypatch):
    import os

    from megatron_ext.metrics import run_logger
    from megatron_ext.resilience.elastic import RESTART_DECIDED_AT

    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", RESTART_DECIDED_AT):
        monkeypatch.delenv(name, raising=False)
    assert run_logger.launcher_start_time() is None  # no agent: python -m recipes.pretrain
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    parent = run_logger.launcher_start_time()  # this test's parent process stands in for the agent
    assert parent == pytest.approx(run_logger.process_start_time(os.getppid()), abs=1e-3)
    assert parent <= run_logger.process_start_time()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the agent restarted its workers: it is older
    assert run_logger.launcher_start_time() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(RESTART_DECIDED_AT, "100.0")  # recipes.launch's agent restarted them for a node joining
    assert run_logger.launcher_start_time() is None

    now = iter([110.0])
    monkeypatch.setattr(run_logger.time, "time", lambda: next(now))
    clock = run_logger.StartupClock(since=95.0)
    clock.mark("launcher", at=98.0)
    clock.mark("imports")
    assert clock.summary() == "15.0 s to the end of the first step: launcher 3.0 s, imports 12.0 s"


def test_each_bottleneck_rule_gives_its_advice_with_the_planners_gain_once_and_a_healthy_run_none():
    from megatron_ext.metrics.advice import Advisor, Machine, advise

    pp2 = load_config(TINY)  # TP2 × PP2, global batch 16, micro batch 4: m = 4 on 4 processes
    h100 = Machine("h100-80gb", 4)
    healthy = {"compute": 0.85, "pipeline": 0.08, "grad_sync": 0.03, "optimizer": 0.03, "data": 0.01}
    assert advise(pp2, 4, healthy, h100, memory_used=0.8) == {}
    slow = {"compute": 0.5, "pipeline": 0.25, "grad_sync": 0.12, "optimizer": 0.03, "data": 0.08}
    said = advise(pp2, 4, slow, h100, memory_used=0.5, stage_compute={0: 1.0, 1: 1.1})
    # balanced stages: the bubble 1/(1·4) = 0.25 of the compute, 0.125 at m = 8: 1.25 / 1.125 = +11 % tokens/s
    assert "the bubble is (PP−1)/(VPP·m) = 1/(1·4) = 0.25 of the compute: m = 8 micro batches per pipeline " \
           "(train.global_batch_size=32) makes it 0.12, +11% tokens/s (planner)" in said["pipeline"]
    assert "interleaving (parallel.virtual_pipeline_model_parallel_size=2)" in said["pipeline"]
    assert "unbalanced" not in said["pipeline"]
    assert re.search(r"parallel.overlap_grad_reduce=true and parallel.overlap_param_gather=true hide it behind the "
                     r"backward pass — the planner expects \d+% of it hidden on h100-80gb, \+\d+% tokens/s",
                     said["grad_sync"]), said["grad_sync"]
    assert "data.num_workers=2 loads batches in the background, up to +9% tokens/s" in said["data"]  # 1 / 0.92
    recomputing = load_config(TINY, ["train.recompute_granularity=full"])
    assert re.fullmatch(r"the peak uses 50% of the GPU's memory: train.micro_batch_size=8: the planner estimates "
                        r"[\d.]+ GiB \(fits\), \+\d+% tokens/s; train.recompute_granularity=null \(now full\): the "
                        r"planner estimates [\d.]+ GiB \(fits\), \+\d+% tokens/s",
                        advise(recomputing, 4, slow, h100, memory_used=0.5)["memory"])
    overlapped = load_config(TINY, ["parallel.overlap_grad_reduce=true"])
    assert "a larger global batch per DP rank" in advise(overlapped, 4, slow, h100)["grad_sync"]
    assert "the planner expects" not in advise(pp2, 4, slow, None)["grad_sync"]  # a GPU it has no entry for

    advisor = Advisor(pp2, 4, h100)
    assert advisor.check(slow) == []  # the first interval holds the first step
    assert advisor.check(slow) == []  # one interval is not yet a trend
    assert len(advisor.check(slow)) == 3 and advisor.check(slow) == []  # each once per run (no GPU memory here)
    noisy = Advisor(pp2, 4, h100)
    for shares in (slow, healthy, {**healthy, "data": 0.09}, healthy, healthy):
        assert noisy.check(shares) == [], shares  # one interval above 5 % data, the window's mean below


def test_the_exposed_gradient_sync_is_the_least_waiting_ranks_not_the_wait_for_a_straggler():
    """Rank 1 finished its backward pass 300 ms early and waited for rank 0 in the sync: the mean over ranks (16 %)
    would advise more overlap; the communication itself (rank 0's 10 ms of a 1 s step) is 1 %."""
    from megatron_ext.metrics.advice import exposed_grad_sync_share

    ranks = [{"grad_sync": 0.01, "step": 1.0}, {"grad_sync": 0.31, "step": 1.0}]
    assert exposed_grad_sync_share(ranks) == pytest.approx(0.01)
    assert exposed_grad_sync_share([{"grad_sync": 0.2, "step": 1.0}, {"grad_sync": 0.25, "step": 1.5}]) == \
        pytest.approx(0.16)  # the least sync over the mean step


def test_unbalanced_stages_are_told_from_the_bubble_and_the_layers_to_move_are_named():
    from megatron_ext.config.schema import pipeline_stage_layers
    from megatron_ext.metrics.advice import stage_imbalance

    pp2 = load_config(TINY)  # 4 layers on 2 stages
    assert stage_imbalance(pp2, {0: 1.0, 1: 1.2}) is None
    # 1 s per layer; the last stage's extra 1.8 s (output layer, loss) is 1.8 layers: one layer moved makes it
    # 1 + 1.8 = 2.8 s against the first stage's 3 s, from 3.8 s: 3.8 / 3 = 27 % faster
    said = stage_imbalance(pp2, {0: 2.0, 1: 3.8})
    assert said == ("pipeline stages are unbalanced: stage 1 computes 1.9× stage 0 per step, and the others wait "
                    "for it; the last stage also runs the output layer and the loss, about 1.8 layers' worth: "
                    "parallel.num_layers_in_last_pipeline_stage=1 moves 1 off it (about 27% faster steps)")
    assert "moves" not in stage_imbalance(pp2, {0: 2.0, 1: 2.8})  # 0.8 layers: moving one would not help
    assert stage_imbalance(pp2, {0: 3.0, 1: 2.0}).endswith("and the others wait for it")  # not the last stage
    pp4 = load_config(TINY, ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=4",
                             "model.num_layers=16", "parallel.num_layers_in_last_pipeline_stage=4"])
    assert pipeline_stage_layers(pp4) == [4, 4, 4, 4]
    # 2.4 layers' worth on the last stage → 3 layers off it, one onto each other stage: max(1 + 2.4, 5) = 5 from 6.4
    assert "num_layers_in_last_pipeline_stage=1 moves 3 off it (about 28% faster steps)" in \
        stage_imbalance(pp4, {0: 4.0, 1: 4.0, 2: 4.0, 3: 6.4})


def test_the_run_summary_sets_the_measured_breakdown_beside_the_planners_and_names_what_disagrees():
    from megatron_ext.metrics.plan_check import PartCheck, check_against_plan, planned_parts
    from megatron_ext.planner import GIB, NON_TORCH_RESERVE_GIB, model_vocab_size, stage_peak_bytes

    pp2 = load_config(TINY)
    on_cpu = planned_parts(pp2, 4, 4, "h100-80gb", on_gpu=False, slowest_compute_s=2.0)
    assert on_cpu["compute"] is None and on_cpu["grad_sync"] is None
    assert 0.25 * 2.0 <= on_cpu["pipeline"] <= 0.3 * 2.0  # (p−1)/(v·m) = 1/4 of the compute, plus the p2p sends
    stage = {"compute": 2.0, "pipeline": 0.5, "grad_sync": 0.1, "optimizer": 0.2, "step": 3.0}
    lines = check_against_plan(pp2, 4, 4, "h100-80gb", False, {0: stage, 1: stage})
    assert lines[1].startswith("  compute: 2000 ms (67% of the step), measured only")
    assert re.match(r"  pipeline: 500 ms \(17% of the step\), planned 5\d\d ms \(1\d% of the step\): agrees",
                    lines[2]), lines
    assert not any("differs" in line for line in lines)
    waiting = {**stage, "pipeline": 2.0, "compute": 1.4, "step": 3.5}
    lines = check_against_plan(pp2, 4, 4, "h100-80gb", False, {0: waiting, 1: {**stage, "step": 3.5}})
    assert "DISAGREES" in lines[2] and lines[-2] == "  differs from the plan by more than 2×: pipeline"
    assert lines[-1].startswith("  pipeline stages are unbalanced: stage 1 computes 1.4× stage 0")
    # a part under 5 % of the step on both sides is not judged; 2× either way is the bound
    assert not PartCheck("grad_sync", 0.04, 0.01, 1.0).disagrees and PartCheck("grad_sync", 0.3, 0.1, 1.0).disagrees
    assert not PartCheck("grad_sync", 0.2, 0.1, 1.0).disagrees and PartCheck("pipeline", 0.0, 0.1, 1.0).disagrees
    # on a GPU every part is planned, and each stage's peak memory is checked within 15 %
    vocab = model_vocab_size(pp2)
    plan = [stage_peak_bytes(pp2, vocab, 4, s) - NON_TORCH_RESERVE_GIB * GIB for s in (0, 1)]
    lines = check_against_plan(pp2, 4, 4, "h100-80gb", True, {0: stage, 1: stage}, {0: plan[0], 1: 2 * plan[1]})
    assert "planned for h100-80gb" in lines[0] and all("measured only" not in line for line in lines)
    assert lines[5].endswith(": agrees") and lines[6].endswith(": DISAGREES"), lines


@pytest.mark.serial  # timed sleeps within 15 ms
def test_step_timers_split_megatron_cores_regions_and_take_the_data_wait_out_of_compute():
    import time

    from megatron_ext.metrics.step_time import StepTimers

    def slow_batches():
        while True:
            time.sleep(0.05)
            yield {}

    timers = StepTimers(on_gpu=False)
    batches = timers.timed_batches(slow_batches())
    timers("forward-backward").start()
    timers("forward-compute").start()
    next(batches)  # megatron-core reads the batch inside its forward-compute region
    time.sleep(0.02)
    timers("forward-compute").stop()
    timers("forward-recv").start()
    time.sleep(0.03)
    timers("forward-recv").stop()
    timers("all-grads-sync").start()
    timers("all-grads-sync").stop()
    timers("forward-backward").stop()
    with timers.region("optimizer"):
        time.sleep(0.01)
    timers("some-region-we-do-not-count").start()
    parts = timers.take()
    # upper bounds allow for a busy machine's late wake-ups, not for the 0.05 s of data counted twice
    assert 0.05 <= parts["data"] < 0.065 and 0.02 <= parts["compute"] < 0.045, parts
    assert 0.03 <= parts["pipeline"] < 0.045 and 0.01 <= parts["optimizer"] < 0.025, parts
    assert parts["schedule"] < 0.01 and parts["grad_sync"] < 0.01, parts
    assert all(v == 0 for v in timers.take().values())  # taken: the next interval starts from zero


def test_step_timers_switched_off_time_nothing_and_pass_batches_through():
    from megatron_ext.metrics.step_time import StepTimers

    timers = StepTimers(on_gpu=False, enabled=False)
    assert list(timers.timed_batches(iter([1, 2]))) == [1, 2]
    with timers.region("optimizer"):
        pass
    timers("forward-compute").start()
    timers("forward-compute").stop()
    assert set(timers.take().values()) == {0.0}


class _QueuedEvent:
    """A CUDA event's contract on a busy GPU: elapsed_time raises until the device has been synchronised after the
    event was recorded (torch: "Both events must be completed before calculating elapsed time")."""

    clock = {"now": 0.0, "synchronised_at": -1.0, "synchronisations": 0}

    def __init__(self, enable_timing: bool = True):
        self.at = None

    def record(self) -> None:
        self.clock["now"] += 1.0
        self.at = self.clock["now"]

    def elapsed_time(self, end: "_QueuedEvent") -> float:
        if max(self.at, end.at) > self.clock["synchronised_at"]:
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.at - self.at) * 1000.0  # one "second" per record, returned in ms as torch does

    @classmethod
    def synchronize(cls) -> None:
        cls.clock["synchronised_at"] = cls.clock["now"]
        cls.clock["synchronisations"] += 1


def test_on_a_gpu_step_metrics_wait_for_the_device_only_on_logging_steps(monkeypatch):
    import types

    import torch

    from megatron_ext.metrics.step_metrics import StepMetrics
    from megatron_ext.metrics.step_time import StepTimers

    monkeypatch.setattr(torch.cuda, "Event", _QueuedEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", _QueuedEvent.synchronize)
    monkeypatch.setattr(_QueuedEvent, "clock", {"now": 0.0, "synchronised_at": -1.0, "synchronisations": 0})
    logged = []
    metrics = StepMetrics.__new__(StepMetrics)  # only what a non-logging step touches
    metrics.cfg = types.SimpleNamespace(logging=types.SimpleNamespace(log_interval=3))
    metrics.timers, metrics.timed, metrics._interval = StepTimers(on_gpu=True), False, {}
    metrics.logger = types.SimpleNamespace(step=lambda iteration, *args, **kw: logged.append(kw["console"]))

    def step(iteration: int) -> None:
        metrics.timers("forward-backward").start()
        metrics.timers("forward-compute").start()  # 1 s
        metrics.timers("forward-compute").stop()
        metrics.timers("forward-backward").stop()
        with metrics.timers.region("optimizer"):  # 1 s, still queued behind the step when it is recorded
            pass
        metrics.step_done()
        metrics.record(iteration, loss=1.0, lr=0.1, grad_norm=1.0, step_time=0.5)

    step(1)
    step(2)
    assert _QueuedEvent.clock["synchronisations"] == 0 and logged == [False, False]
    with metrics.timers.region("optimizer"):  # an evaluation's or skipped step's region is forgotten, unread
        pass
    metrics.discard()
    taken, take = [], metrics.timers.take
    metrics.timers.take = lambda: taken.append(take()) or taken[-1]
    step(3)
    assert _QueuedEvent.clock["synchronisations"] == 1 and logged == [False, False, True]
    # three steps of 1 s compute, 2 s of the schedule around it and 1 s optimizer; the discarded region not counted
    assert (taken[0]["compute"], taken[0]["schedule"], taken[0]["optimizer"]) == (3.0, 6.0, 3.0), taken


def test_the_plan_check_compares_every_part_the_planner_estimates():
    """Each of the planner's step-time components (an MoE model's all-to-all and an offloaded optimizer's host step
    included) falls in exactly one measured part, so the planned total is the planner's step."""
    from megatron_ext.metrics.plan_check import PLANNED_PARTS, planned_parts
    from megatron_ext.planner import estimate, model_vocab_size

    components = [c for part in PLANNED_PARTS.values() for c in part]
    moe = load_config(ROOT / "configs" / "tiny_moe.yaml", ["optimizer.optimizer_cpu_offload=true",
                                                           "train.precision=bf16"])
    time = estimate(moe, 8, 8, GPUS["h100-80gb"], model_vocab_size(moe)).time
    assert sorted(components) == sorted(set(time) - {"step"}) and time["moe_comm"] > 0 and time["offload"] > 0
    planned = planned_parts(moe, 8, 8, "h100-80gb", on_gpu=True, slowest_compute_s=1.0)
    assert sum(planned.values()) == pytest.approx(time["step"])


def test_the_log_gives_mfu_in_torchtitans_convention_beside_megatron_lms(monkeypatch):
    """torchtitan (and PaLM) count the whole s×s score matrix, Megatron-LM its causal half: the second scalar is
    the first plus exactly the other half, 6·L·(heads·head_dim)·s FLOPs per token."""
    from megatron_ext.metrics.run_logger import RunLogger

    cfg = load_config(TINY, ["logging.gpu_peak_tflops=100"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    scalars = RunLogger(cfg, 1000, world_size=2, enabled=False).step(1, 2.0, 1e-4, 1.0, step_time=0.5,
                                                                      console=False)
    m = cfg.model
    tokens = cfg.train.global_batch_size * m.seq_length
    other_half = 6 * m.num_layers * m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads) \
        * m.seq_length * tokens
    assert scalars["train/mfu_full_attention"] - scalars["train/mfu"] == pytest.approx(other_half / 0.5 / 2 / 1e14)


def test_a_run_resumed_inside_the_profile_window_traces_from_where_it_resumed(tmp_path):
    """logging.profile_steps=[2,4] and a run resumed at iteration 2 (its first step is 3): the trace covers 3-4
    instead of the run crashing at 4 on a profile never started; a rewind back into the window traces nothing more."""
    from megatron_ext.metrics.profiler import StepProfiler

    cfg = load_config(TINY, ["logging.profile_steps=[2,4]", f"logging.log_dir={tmp_path / 'logs'}"])
    profiler = StepProfiler(cfg, rank=0, on_gpu=False)
    for iteration in (3, 4, 3, 4):
        with profiler.step(iteration):
            torch.ones(4).sum()
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank-0.iter_3-4.json"]
