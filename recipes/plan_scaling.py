"""``python -m recipes.plan --config X.yaml --scaling N1,N2,... [--gpu G] [--json] [--plot F.png]``: the recipe's
model at each GPU count, strong scaling (the recipe's global batch) and weak scaling (its batch per GPU at the
smallest count): the best layout's tokens/s/GPU, the speed-up over the smallest count, the efficiency and what costs
it (megatron_ext/planner/scaling.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from megatron_ext.config.schema import load_config
from megatron_ext.errors import ConfigError
from megatron_ext.hardware import GPUS
from megatron_ext.planner.scaling import ScalingPoint, scaling


def _say(mode: str, points: list[ScalingPoint]) -> str:
    lines = [f"{mode} scaling:", f"{'GPUs':>7} {'batch':>7} {'tok/s/GPU':>10} {'speed-up':>9} {'efficiency':>10}  "
             "layout; what costs the efficiency"]
    for p in points:
        if p.best is None:
            lines.append(f"{p.gpus:>7} {p.global_batch_size:>7}  nothing fits")
            continue
        lines.append(f"{p.gpus:>7} {p.global_batch_size:>7} {p.best.tokens_per_s_per_gpu:>10,.0f} "
                     f"{p.speedup or 0:>8.2f}× {100 * (p.efficiency or 0):>9.0f} %  {p.best.layout.label()}"
                     + (f"; {p.cause}" if p.cause else ""))
    return "\n".join(lines)


def _markdown(mode: str, points: list[ScalingPoint]) -> str:
    lines = [f"| {mode} scaling: GPUs | global batch | tokens/s/GPU | speed-up | efficiency | layout | what costs it |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {p.gpus} | {p.global_batch_size} | nothing fits | | | | |" if p.best is None else
              f"| {p.gpus} | {p.global_batch_size} | {p.best.tokens_per_s_per_gpu:,.0f} | {p.speedup or 0:.2f}× | "
              f"{100 * (p.efficiency or 0):.0f} % | {p.best.layout.label()} | {p.cause or ''} |" for p in points]
    return "\n".join(lines)


def plot(results: dict[str, list[ScalingPoint]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in results.items():
        shown = [p for p in points if p.speedup is not None]
        ax.plot([p.gpus for p in shown], [p.speedup for p in shown], marker="o", label=f"{mode} scaling")
    counts = [p.gpus for p in next(iter(results.values()))]
    ax.plot(counts, [c / counts[0] for c in counts], linestyle="--", color="grey", label="ideal")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel(f"speed-up over {counts[0]} GPUs")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.plan --scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--scaling", required=True, help="GPU counts, comma-separated (e.g. 64,128,256)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the GPU's node (8; NVL72 trays: 4)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100-80gb")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="the tables as docs/planner.md shows them")
    parser.add_argument("--plot", help="write the speed-up curves to this PNG")
    parser.add_argument("overrides", nargs="*", help="section.key=value applied to the config first")
    args = parser.parse_args(argv)
    try:
        counts = sorted({int(n) for n in args.scaling.split(",")})
        cfg = load_config(args.config, list(args.overrides))
        node = args.gpus_per_node or GPUS[args.gpu].node_gpus
        results = {mode: scaling(cfg, counts, node, args.gpu, mode) for mode in ("strong", "weak")}
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({mode: [p.to_dict() for p in points] for mode, points in results.items()}, indent=1))
    elif args.markdown:
        print("\n\n".join(_markdown(mode, points) for mode, points in results.items()))
    else:
        print(f"{cfg.recipe.name} on {GPUS[args.gpu].name}, seq {cfg.model.seq_length}:\n")
        print("\n\n".join(_say(mode, points) for mode, points in results.items()))
    if args.plot:
        plot(results, args.plot, f"{cfg.recipe.name} on {GPUS[args.gpu].name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
