"""Throughput accounting: the FLOPs formula (config.shape) against a hand count, the MFU peak table (hardware)."""

from __future__ import annotations

from megatron_ext.config.schema import load_config
from megatron_ext.config.shape import ModelShape
from megatron_ext.hardware import GPUS, PEAK_BF16_TFLOPS, peak_bf16_tflops
from tests.launch import TINY


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
    from megatron_ext.metrics.run_logger import TimeLeft, format_duration

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


def test_each_bottleneck_rule_gives_its_advice_once_and_a_healthy_run_none():
    from megatron_ext.metrics.advice import Advisor, advise

    pp2 = load_config(TINY)  # TP2 × PP2, global batch 16, micro batch 4: m = 4 on 4 processes
    healthy = {"compute": 0.85, "pipeline": 0.08, "grad_sync": 0.03, "optimizer": 0.03, "data": 0.01}
    assert advise(pp2, 4, healthy, memory_used=0.8) == {}
    slow = {"compute": 0.5, "pipeline": 0.25, "grad_sync": 0.12, "optimizer": 0.03, "data": 0.08}
    said = advise(pp2, 4, slow, memory_used=0.5)
    assert "train.micro_batch_size (now m = 4 per pipeline), or interleave stages" in said["pipeline"]
    assert "parallel.overlap_grad_reduce=true" in said["grad_sync"] and "data.num_workers=2" in said["data"]
    assert "uses 50% of the GPU's memory: a larger train.micro_batch_size" in said["memory"]
    overlapped = load_config(TINY, ["parallel.overlap_grad_reduce=true"])
    assert "a larger global batch per DP rank" in advise(overlapped, 4, slow)["grad_sync"]
    advisor = Advisor(pp2, 4)
    assert advisor.check(slow) == []  # the first interval holds the first step
    assert len(advisor.check(slow)) == 3 and advisor.check(slow) == []  # each once per run


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
