"""``python -m recipes.plan --published FILE.csv [--json] [--markdown]``: every row of a published-runs CSV
(docs/published-runs.csv's columns) re-planned at its own layout, precision and features, beside the published
tokens/s/GPU (megatron_ext/planner/published.py), then the summary: rows planned, median and 90th-percentile |error|,
the share within 20 %, the worst row."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from megatron_ext.errors import ConfigError
from megatron_ext.planner.published import Replanned, read_published, replan, summary

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _line(r: Replanned) -> str:
    run = r.run
    head = f"#{run.idx:<3} {run['model'][:24]:24} {run['num_gpus']:>5}× {run['gpu']:15} {run['precision']:15}"
    if r.reason:
        return f"{head} not planned: {r.reason}"
    assert r.error is not None and r.planned is not None and r.published is not None
    parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in r.parts)
    published = f"{r.published:,.0f}" + ("*" if r.derived else "")
    return f"{head} planned {r.planned:>8,.0f}  published {published:>8}  {100 * r.error:+5.0f} %  ({parts})"


def markdown(results: list[Replanned]) -> str:
    """The comparison as docs/planner.md's table (generated: tests/unit/test_generated_docs.py)."""
    lines = ["| # | model | GPUs | precision | layout | planned | published | error | largest parts (s/step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        run = r.run
        head = f"| {run.idx} | {run['model']} | {run['num_gpus']}× {run['gpu']} | {run['precision']} |"
        if r.reason:
            lines.append(f"{head} | not planned: {r.reason} | | | | |")
            continue
        assert r.estimate is not None and r.error is not None
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in r.parts)
        published = f"{r.published:,.0f}" + ("*" if r.derived else "")
        lines.append(f"{head} {r.estimate.layout.label()} | {r.planned:,.0f} | {published} | {100 * r.error:+.0f} % "
                     f"| {parts} |")
    s = summary(results)
    lines.append("")
    lines.append(f"{s['planned']} of {s['rows']} rows planned; median |error| {100 * s.get('median_abs_error', 0):.1f} %, "
                 f"90th percentile {100 * s.get('p90_abs_error', 0):.1f} %, {100 * s.get('within_20_percent', 0):.0f} % "
                 f"of rows within 20 %, worst #{s['worst']['idx']} ({100 * s['worst']['abs_error']:.0f} %). "
                 "\\* published as TFLOP/s only: tokens/s derived with the FLOP count the source uses (the row's notes).")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.plan --published", description=__doc__.splitlines()[0])
    parser.add_argument("--published", required=True, help="a CSV with docs/published-runs.csv's columns")
    parser.add_argument("--json", action="store_true", help="one object per row and the summary")
    parser.add_argument("--markdown", action="store_true", help="docs/planner.md's table")
    args = parser.parse_args(argv)
    try:
        results = [replan(run, CONFIGS) for run in read_published(args.published)]
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"rows": [r.to_dict() for r in results], "summary": summary(results)}, indent=1))
    elif args.markdown:
        print(markdown(results))
    else:
        for r in results:
            print(_line(r))
        s = summary(results)
        print(f"\n{s['planned']} of {s['rows']} rows planned: median |error| {100 * s['median_abs_error']:.1f} %, "
              f"90th percentile {100 * s['p90_abs_error']:.1f} %, {100 * s['within_20_percent']:.0f} % within 20 %, "
              f"worst #{s['worst']['idx']} ({100 * s['worst']['abs_error']:.0f} %)"
              "; * = published as TFLOP/s only (tokens/s derived with the source's FLOP count, as the row's notes say)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
