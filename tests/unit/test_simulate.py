"""The goodput simulation against the closed forms it must reproduce where they exist (Daly's expected wall-clock,
a spare for every failure, spikes alone), the spare bookkeeping, and the command line."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from megatron_ext.planner.goodput import daly_interval_s
from megatron_ext.planner.simulate import Job, expected_wall_s, simulate, sweep

HOUR = 3600.0
DALY = daly_interval_s(60.0, 3 * HOUR)


def _job(interval_s: float = DALY, **kw) -> Job:
    work = round(200 * HOUR / interval_s) * interval_s  # a whole number of segments, as the closed form assumes
    return Job(work_s=work, gpus=1024, gpus_per_node=8, mtbf_s=3 * HOUR, interval_s=interval_s, stall_s=60.0,
               restart_s=600.0, **kw)


@pytest.mark.parametrize("factor, restart_s", [(1 / 3, 600.0), (1.0, 600.0), (3.0, 600.0), (1.0, 1.5 * HOUR)])
def test_without_spares_or_spikes_the_mean_wall_clock_is_dalys(factor, restart_s):
    """Daly's e^{R/M}: a failure during a restart repeats it (a restart of half the MTBF shows it: 1.65×)."""
    job = replace(_job(DALY * factor), restart_s=restart_s)
    simulated = simulate(job, trials=400)
    assert simulated.wall_s == pytest.approx(expected_wall_s(job), rel=0.01)
    assert simulated.goodput_p5 < simulated.goodput < simulated.goodput_p95


def test_the_simulated_optimum_is_dalys_interval():
    """The curve is flat near its top: Daly's interval is within 0.2 points of the best of a grid around it, and the
    grid's ends are worse."""
    factors = [0.25, 0.5, 0.7, 1.0, 1.4, 2.0, 4.0]
    points = sweep(_job(), [f * DALY for f in factors], [0], trials=400)[0]
    goodput = [p.goodput for p in points]
    assert max(goodput) - goodput[factors.index(1.0)] < 0.002
    assert goodput[0] < goodput[factors.index(1.0)] - 0.005 and goodput[-1] < goodput[factors.index(1.0)] - 0.005


def test_a_spare_for_every_failure_makes_each_restart_a_spares():
    job = _job(spare_nodes=2, spare_restart_s=120.0, repair_s=0.0)
    simulated = simulate(job, trials=400)
    assert simulated.cold_restarts == 0 and simulated.failures > 50
    assert simulated.wall_s == pytest.approx(expected_wall_s(replace(job, restart_s=120.0)), rel=0.01)
    held = job.gpus + 2 * job.gpus_per_node  # the spares' GPUs are held too
    assert simulated.goodput == pytest.approx(job.work_s * job.gpus / (simulated.wall_s * held), rel=0.01)


def test_spares_that_never_come_back_cover_only_the_first_failures():
    simulated = simulate(_job(spare_nodes=3, spare_restart_s=120.0, repair_s=1e12), trials=200)
    assert simulated.failures - simulated.cold_restarts == pytest.approx(3.0)


def test_spikes_alone_rewind_as_daly_without_failures_during_the_reload():
    job = replace(_job(spikes_per_hour=1 / 3, rewind_s=300.0), mtbf_s=1e15)
    simulated = simulate(job, trials=400)
    assert simulated.failures == 0 and simulated.spikes > 50
    segments, rate, segment = job.work_s / job.interval_s, 1 / (3 * HOUR), job.interval_s + job.stall_s
    expected = segments * math.expm1(segment * rate) * (1 / rate + job.rewind_s)
    assert simulated.wall_s == pytest.approx(expected, rel=0.01)


def test_the_command_prints_each_spare_count_and_writes_the_plot(tmp_path, capsys):
    from recipes.simulate import main

    plot = tmp_path / "goodput.png"
    assert main(["--config", "configs/llama3_8b_8gpu_bf16.yaml", "--gpus", "64", "--spares", "0", "2",
                 "--trials", "20", "--spikes-per-day", "2", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["spares"]) == ["0", "2"] and len(out["spares"]["0"]) == len(out["intervals_s"]) > 3
    assert out["daly_interval_s"] in out["intervals_s"] and 0.9 < out["daly_goodput_closed_form"] < 1
    assert out["spares"]["0"][0]["spikes"] > 0 and plot.stat().st_size > 10_000


def test_the_llama3_scale_table_in_the_planner_doc_is_what_the_command_prints(capsys):
    """docs/planner.md's 16,384-GPU table, from the command it shows (seed 0)."""
    import re

    from recipes.simulate import main
    from tests.launch import ROOT

    doc = (ROOT / "docs" / "planner.md").read_text()
    command = doc.split("python -m recipes.simulate --config configs/llama3_1_405b_40gpu_bf16.yaml")[1].split("```")[0]
    args = command.replace("\\\n", " ").split()
    assert main(["--config", "configs/llama3_1_405b_40gpu_bf16.yaml", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    table = doc.split("| interval | 0 spares |")[1].split("\n\n")[0]
    for row in table.strip().splitlines()[2:]:  # after the header's rest and the separator
        cells = [c.strip() for c in row.strip("|").split("|")]
        minutes, seconds = map(int, re.match(r"(\d+) min (\d+) s", cells[0]).groups())
        i = min(range(len(out["intervals_s"])), key=lambda k: abs(out["intervals_s"][k] - 60 * minutes - seconds))
        for spares, cell in zip(["0", "1", "2", "4"], cells[1:]):
            point = out["spares"][spares][i]
            assert cell == f"{100 * point['goodput']:.2f} ± {100 * point['goodput_std']:.2f} %", (row, spares)
