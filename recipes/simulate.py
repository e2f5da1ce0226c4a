"""Goodput of a long pretraining job by Monte Carlo: ``python -m recipes.simulate --config X.yaml --gpus N``.

The job is the recipe's ``train.train_iters`` at the planner's step time for its own layout on N GPUs (or, where
that layout does not fit, the fastest one that does), its checkpoint's save stall and the job's failure rate as
``recipes.plan`` computes them; the simulation adds what the closed form cannot: hot spare nodes, loss-spike rewinds
and the spread over many runs (megatron_ext/planner/simulate.py). Prints, per spare count, the goodput at each
checkpoint interval around Daly's and the best; ``--plot FILE.png`` draws goodput against the interval, one curve per
spare count; ``--json`` gives every point.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from megatron_ext.errors import ConfigError
from megatron_ext.metrics.units import format_duration
from megatron_ext.planner import plan
from megatron_ext.planner.simulate import Job, Simulated, expected_wall_s, sweep
from recipes.plan import add_job_arguments, config_layout_estimate, job_checkpoint_interval, load_job_config

# Assumed, not measured (say so where they are printed): a restart onto a hot spare skips the requeue and the
# scheduler's wait for a replacement node, leaving the rendezvous, start-up and checkpoint load; a failed node is
# back in service a day later.
DEFAULT_SPARE_RESTART_S = 180.0
DEFAULT_REPAIR_HOURS = 24.0
INTERVAL_FACTORS = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)  # × Daly's interval


def _plot(path: Path, intervals_s: list[float], results: dict[int, list[Simulated]], daly_s: float,
          title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    minutes = [s / 60 for s in intervals_s]
    for spares, points in results.items():
        mean = [100 * p.goodput for p in points]
        ax.plot(minutes, mean, marker="o", markersize=3, label=f"{spares} spare node{'s' * (spares != 1)}")
        ax.fill_between(minutes, [100 * p.goodput_p5 for p in points], [100 * p.goodput_p95 for p in points],
                        alpha=0.15)
    ax.axvline(daly_s / 60, color="grey", linestyle=":", label="Daly's interval")
    ax.set_xscale("log")
    ax.set_xticks(minutes, [format_duration(s) for s in intervals_s], rotation=30, fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("checkpoint interval (training between saves)")
    ax.set_ylabel("goodput % (mean; band: 5th-95th percentile)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.simulate", description=__doc__.splitlines()[0])
    add_job_arguments(parser)
    parser.add_argument("--spares", type=int, nargs="+", default=[0, 1, 2, 4], help="spare node counts to compare")
    parser.add_argument("--spare-restart-s", type=float, default=DEFAULT_SPARE_RESTART_S,
                        help="a restart onto a hot spare (assumed default: rendezvous, start-up, checkpoint load)")
    parser.add_argument("--repair-hours", type=float, default=DEFAULT_REPAIR_HOURS,
                        help="until a failed node is back as a spare (assumed default)")
    parser.add_argument("--spikes-per-day", type=float, default=0.0,
                        help="loss spikes per day of training that need a rewind to the last checkpoint")
    parser.add_argument("--rewind-s", type=float, default=None,
                        help="a rewind's reload; default: reading the checkpoint back at --checkpoint-write-gb-s")
    parser.add_argument("--trials", type=int, default=200, help="simulated runs per point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, help="write goodput against the interval as a PNG")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        cfg = load_job_config(args)
        planned, _ = config_layout_estimate(cfg, args)
        if planned is None or not planned.fits:
            planned = next((e for e in plan(cfg, args.gpus, args.gpus_per_node, args.gpu, args.mfu,
                                            not args.bf16_grads) if e.fits), None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if planned is None:
        print(f"error: no layout of {cfg.recipe.name} fits {args.gpus} GPUs (python -m recipes.plan says why)",
              file=sys.stderr)
        return 1
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib (pip install -r requirements-dev.txt)", file=sys.stderr)
            return 2
    step_s = planned.time["step"]
    checkpoint = job_checkpoint_interval(cfg, args, step_s)
    rewind_s = args.rewind_s if args.rewind_s is not None else checkpoint.background_write_s or checkpoint.stall_s
    daly_s = checkpoint.interval_s
    floor = max(step_s, checkpoint.background_write_s)  # an asynchronous save waits for the previous write
    intervals = sorted({daly_s, *(f * daly_s for f in INTERVAL_FACTORS if f * daly_s >= floor and
                                  abs(f - 1) > 0.05)} | ({floor} if floor < 0.95 * daly_s else set()))
    job = Job(work_s=cfg.train.train_iters * step_s, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
              mtbf_s=checkpoint.mtbf_s, interval_s=daly_s, stall_s=checkpoint.stall_s, restart_s=args.restart_s,
              spare_restart_s=args.spare_restart_s, repair_s=args.repair_hours * 3600,
              spikes_per_hour=args.spikes_per_day / 24, rewind_s=rewind_s)
    results = sweep(job, intervals, sorted(set(args.spares)), args.trials, args.seed)
    closed_form = job.work_s / expected_wall_s(job)
    if args.json:
        print(json.dumps({"job": asdict(job), "layout": planned.layout.label(), "daly_interval_s": daly_s,
                          "daly_goodput_closed_form": closed_form, "intervals_s": intervals,
                          "spares": {spares: [p.to_dict() for p in points] for spares, points in results.items()}},
                         indent=1))
    else:
        _report(cfg.recipe.name, args, planned.layout.label(), job, intervals, results, daly_s, closed_form)
    if args.plot:
        _plot(args.plot, intervals, results, daly_s,
              f"{cfg.recipe.name} on {args.gpus} GPUs: {format_duration(job.work_s)} of training, "
              f"MTBF {format_duration(job.mtbf_s)}")
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def _report(name: str, args: argparse.Namespace, layout: str, job: Job, intervals: list[float],
            results: dict[int, list[Simulated]], daly_s: float, closed_form: float) -> None:
    print(f"{name} on {args.gpus} GPUs ({layout}): {format_duration(job.work_s)} of training, job MTBF "
          f"{format_duration(job.mtbf_s)}, save stall {job.stall_s:.1f} s, cold restart {job.restart_s:.0f} s, "
          f"spare restart {job.spare_restart_s:.0f} s and repair {format_duration(job.repair_s)} (assumed unless "
          f"given), {args.spikes_per_day:g} loss spikes per day (rewind {job.rewind_s:.0f} s); {args.trials} runs "
          f"per point")
    print(f"Daly's interval {format_duration(daly_s)}: closed form (no spares, no spikes) {100 * closed_form:.2f} %")
    header = "interval".rjust(12) + "".join(f"{f'{s} spare(s)':>22}" for s in results)
    print(header)
    for i, interval in enumerate(intervals):
        cells = "".join(f"{100 * pts[i].goodput:>13.2f} ± {100 * pts[i].goodput_std:5.2f}" for pts in results.values())
        print(f"{format_duration(interval):>12}{cells}" + ("   ← Daly" if abs(interval - daly_s) < 1e-6 else ""))
    for spares, points in results.items():
        best = max(range(len(points)), key=lambda i: points[i].goodput)
        p = points[best]
        print(f"{spares} spare node(s): best at {format_duration(intervals[best])}, goodput {100 * p.goodput:.2f} % "
              f"(5th-95th percentile {100 * p.goodput_p5:.2f}-{100 * p.goodput_p95:.2f}), {p.failures:.0f} failures "
              f"per run, {p.cold_restarts:.0f} without a free spare, {p.spikes:.0f} rewinds")


if __name__ == "__main__":
    sys.exit(main())
