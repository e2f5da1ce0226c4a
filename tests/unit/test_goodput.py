"""The checkpoint interval (megatron_ext/planner/goodput.py) against the closed forms it rests on — Young's √(2CM),
Daly's higher-order estimate, the first-order goodput's numeric optimum — and the shipped recipes against it."""

from __future__ import annotations

import math

import pytest

from megatron_ext.config.schema import load_config
from megatron_ext.hardware import GPUS
from megatron_ext.planner import estimate, model_vocab_size
from megatron_ext.planner.goodput import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    checkpoint_interval,
    daly_interval_s,
    expected_goodput,
    job_mtbf_s,
    recipe_checkpoint_interval,
    save_stall_s,
    young_interval_s,
)
from tests.launch import ROOT


def test_llama3s_interruption_rate_gives_its_three_hours_between_failures_at_16k_gpus():
    assert job_mtbf_s(16384) / 3600 == pytest.approx(54 * 24 / 419)  # 3.09 h
    assert LLAMA3_FAILURES_PER_GPU_HOUR == pytest.approx(1.97e-5, rel=1e-2)


@pytest.mark.parametrize("stall_s, mtbf_s", [(30.0, 3 * 3600.0), (5.0, 24 * 3600.0), (300.0, 3600.0)])
def test_daly_refines_young_toward_the_numeric_optimum_of_the_goodput(stall_s, mtbf_s):
    young, daly = young_interval_s(stall_s, mtbf_s), daly_interval_s(stall_s, mtbf_s)
    assert young == pytest.approx(math.sqrt(2 * stall_s * mtbf_s))
    grid = [young * (0.2 + i / 1000) for i in range(3000)]
    best = max(grid, key=lambda t: expected_goodput(t, stall_s, mtbf_s, restart_s=0.0))
    # Daly's estimate is nearer the first-order goodput's optimum than Young's, and within 10 % of it even where the
    # save is a twelfth of the MTBF (there Young's is 26 % off)
    assert abs(daly - best) <= abs(young - best) and daly == pytest.approx(best, rel=0.1)
    assert daly_interval_s(2 * mtbf_s, mtbf_s) == mtbf_s  # a save as long as two MTBFs: Daly's limit


def test_an_asynchronous_save_is_not_recommended_faster_than_its_write():
    """The next save waits for the previous write: below it the wait is stall, and the interval stays above it."""
    i = checkpoint_interval(step_s=1.0, stall_s=0.1, gpus=16384, configured_steps=10, background_write_s=60.0)
    assert i.steps == 60 and i.goodput > i.configured_goodput
    assert expected_goodput(10.0, 0.1, 3600.0, 0.0, background_write_s=60.0) == pytest.approx(
        expected_goodput(10.0, 50.1, 3600.0, 0.0))
    assert save_stall_s(17e9, 1.0, asynchronous=True) == pytest.approx(0.5)  # the measured H100 staging copy


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*gpu*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_saves_often_enough_for_its_gpu_count(path):
    """At Llama 3's failure rate and the planner's step time, a recipe's checkpoint.save_interval costs at most one
    point of expected goodput against the recommended interval (the 405B recipe's 250 steps once cost 9)."""
    cfg = load_config(path)
    gpus, vocab = cfg.recipe.gpus, model_vocab_size(cfg)
    i = recipe_checkpoint_interval(cfg, gpus, estimate(cfg, gpus, 8, GPUS["h100-80gb"], vocab).time["step"], vocab)
    assert i.configured_goodput >= i.goodput - 0.01, (path.name, i)


def test_a_save_interval_that_costs_goodput_gets_one_line_of_advice_at_start_up():
    """The 70B recipe on 8,192 GPUs (a 6-hour MTBF) at 6 s a step: saving every 2,000 steps, every 300 or only at the
    end costs more than 3 points of expected goodput against the planner's interval; every 100 steps does not."""
    from megatron_ext.metrics.advice import checkpoint_interval_advice

    def advice(save_interval: str):
        cfg = load_config(ROOT / "configs" / "llama3_70b_64gpu_bf16.yaml", [f"checkpoint.save_interval={save_interval}"])
        return checkpoint_interval_advice(recipe_checkpoint_interval(cfg, 8192, 6.0, 128256), cfg.train.train_iters)

    line = advice("2000")
    assert line.startswith("checkpoint.save_interval=2000 gives an expected goodput of 70.4 %, against 97.1 % with a "
                           "save every 17 steps (1 min 42 s)") and "set checkpoint.save_interval=17" in line, line
    assert "MTBF of 6 h 11 min" in line and "\n" not in line
    assert advice("300").startswith("checkpoint.save_interval=300 gives an expected goodput of 93.3 %")
    assert advice("null").startswith("saving only at the end (checkpoint.save_interval unset) gives an expected "
                                     "goodput of 0.0 %")
    assert advice("100") is None
