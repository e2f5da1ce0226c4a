"""Layout planner: ``python -m recipes.plan --config X.yaml --gpus N --gpus-per-node G --gpu h100-80gb``; with
``--published FILE.csv`` the published runs re-planned (recipes/plan_published.py), with ``--scaling N1,N2,...`` the
recipe's strong and weak scaling (recipes/plan_scaling.py).

Estimates per-GPU memory and step time for every TP/PP/VPP/CP/DP layout the recipe accepts
(see megatron_ext/planner/layouts.py and docs/planner.md), ranks those that fit and explains the best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional

from megatron_ext.config.schema import ZERO_LEVEL, RecipeConfig, load_config
from megatron_ext.config.validate import validate_layout
from megatron_ext.errors import ConfigError
from megatron_ext.hardware import GPUS, GPUSpec
from megatron_ext.metrics.units import format_duration
from megatron_ext.planner import (
    FRAGMENTATION,
    GIB,
    Estimate,
    Layout,
    checkpoint_bytes,
    compiled_layers,
    estimate,
    explain,
    kernel_efficiency,
    model_vocab_size,
    plan,
)
from megatron_ext.planner.compute_time import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, architecture
from megatron_ext.planner.goodput import (
    DEFAULT_RESTART_S,
    DEFAULT_WRITE_GB_S,
    LLAMA3_FAILURES_PER_GPU_HOUR,
    CheckpointInterval,
    checkpoint_write_s,
    recipe_checkpoint_interval,
)
from megatron_ext.planner.search import pipeline_splits
from megatron_ext.planner.step_time import te_layers
from megatron_ext.planner.timeouts import recipe_timeouts, timeout_warnings

COLUMNS = ["#", "TP", "PP", "VPP", "CP", "DP", "SP", "ZeRO", "recomp", "mbs", "m", "params", "grads", "optim",
           "activ", "buffers", "total GiB", "step s", "bubble", "MFU", "tok/s/GPU"]
EXPERT_COLUMN = COLUMNS.index("SP")  # an MoE model's tables show EP (and ETP where it is not TP) before SP


def _zero(L: Layout) -> str:
    """The data-parallel sharding: 0 (DDP), 1 (distributed optimizer), 2/3 (Megatron-FSDP), HSDP's groups, and the
    optimizer state's share in host memory."""
    level = ZERO_LEVEL[L.sharding] if L.sharding else int(L.distopt)
    return f"{level}" + (f" H{L.replicas}" if L.replicas > 1 else "") + (f" off{L.offload:.0%}" if L.offload else "")


def _row(i: int, e: Estimate, moe: bool) -> list[str]:
    L, mem, t = e.layout, e.memory, e.time
    gib = [f"{mem[k] / GIB:.1f}" for k in ("params", "grads", "optimizer", "activations")]
    row = [str(i), str(L.tp), str(L.pp), str(L.vpp or "-"), str(L.cp), str(L.dp), "y" if L.sp else "n",
           _zero(L), L.recompute or "none", str(L.mbs), str(e.num_microbatches), *gib,
           f"{(mem['buffers'] + mem['reserved']) / GIB:.1f}", f"{mem['total'] / GIB:.1f}",
           f"{t['step']:.2f}", f"{100 * t['pp_bubble'] / t['step']:.0f}%", f"{100 * e.mfu:.0f}%",
           f"{e.tokens_per_s_per_gpu:,.0f}"]
    if moe:
        row.insert(EXPERT_COLUMN, f"{L.ep}" + (f" T{L.etp}" if L.etp is not None else ""))
    return row


def _table(rows: list[list[str]], title: str) -> str:
    """Rows under COLUMNS (and EP for an MoE model's): through `rich` when it is installed, else aligned plain
    text."""
    columns = COLUMNS if not rows or len(rows[0]) == len(COLUMNS) else [
        *COLUMNS[:EXPERT_COLUMN], "EP", *COLUMNS[EXPERT_COLUMN:]]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
        lines = [title, "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    console = Console(width=200, record=True, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    return capture.get().rstrip()


def _kernels_line(cfg: RecipeConfig, mfu: Optional[float], gpu: GPUSpec) -> str:
    """How the plan times the layers: TransformerEngine's kernel by kernel, or the local layers' one efficiency."""
    if te_layers(cfg) and not mfu:
        arch = architecture(gpu)
        return (f"TransformerEngine's layers, kernel by kernel: GEMMs at {100 * GEMM_EFFICIENCY[arch]:.0f} % of the "
                f"precision's peak, attention at {100 * ATTENTION_EFFICIENCY[arch]:.0f} % of BF16 peak (fitted to "
                "the published runs, docs/planner.md)")
    return f"layer kernels at {100 * (mfu or kernel_efficiency(cfg)):.1f} % of peak " + (
        "(--mfu)" if mfu else f"(calibrated, {'compiled' if compiled_layers(cfg) else 'eager'} local layers)")


def _markdown(estimates: list[Estimate]) -> str:
    rows = ["| # | layout | GiB | s/step | MFU |", "|---|---|---|---|---|"]
    rows += [f"| {i} | {e.layout.label().removesuffix(' recompute=none')} | {e.memory['total'] / GIB:.1f} | "
             f"{e.time['step']:.2f} | {100 * e.mfu:.0f} % |" for i, e in enumerate(estimates, 1)]
    return "\n".join(rows)


def _time_to_train(e: Estimate, train_iters: int, gpus: int) -> dict[str, float]:
    seconds = e.time["step"] * train_iters
    return {"seconds": seconds, "gpu_hours": seconds / 3600 * gpus}


def _say_time_to_train(label: str, e: Estimate, train_iters: int, gpus: int) -> str:
    t = _time_to_train(e, train_iters, gpus)
    return f"{label}: {format_duration(t['seconds'])} ({t['gpu_hours']:,.0f} GPU-hours)"


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe, machine and failure arguments recipes.plan and recipes.simulate share."""
    parser.add_argument("--config", required=True, help="recipe YAML (its model and batch are planned for)")
    parser.add_argument("--gpus", type=int, required=True, help="total GPUs (world size)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (TP stays inside one)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100-80gb")
    parser.add_argument("--seq-length", type=int, help="override model.seq_length")
    parser.add_argument("--global-batch-size", type=int, help="override train.global_batch_size")
    parser.add_argument("--mfu", type=float, default=None,
                        help="kernel efficiency (fraction of dense BF16 peak); default: calibrated on H100 "
                             "measurements for eager or compiled layers, as train.compile runs them")
    parser.add_argument("--bf16-grads", action="store_true",
                        help="what-if: bf16 grad buffers (the recipe reduces grads in fp32)")
    parser.add_argument("--checkpoint-write-gb-s", type=float, default=DEFAULT_WRITE_GB_S,
                        help="aggregate write bandwidth to checkpoint.save's file system, for the save time")
    parser.add_argument("--failures-per-gpu-hour", type=float, default=LLAMA3_FAILURES_PER_GPU_HOUR,
                        help="for the checkpoint interval: default Llama 3's 419 interruptions in 54 days on 16,384 "
                             "H100s")
    parser.add_argument("--restart-s", type=float, default=DEFAULT_RESTART_S,
                        help="for the checkpoint interval: what one failure costs before training goes on (requeue, "
                             "start-up, checkpoint load)")
    parser.add_argument("overrides", nargs="*", help="section.key=value applied to the config first")


def load_job_config(args: argparse.Namespace) -> RecipeConfig:
    """The recipe with the command line's overrides (ConfigError when invalid)."""
    overrides = list(args.overrides)
    if args.seq_length:
        overrides.append(f"model.seq_length={args.seq_length}")
    if args.global_batch_size:
        overrides.append(f"train.global_batch_size={args.global_batch_size}")
    return load_config(args.config, overrides)


def config_layout_estimate(cfg: RecipeConfig, args: argparse.Namespace) -> tuple[Optional[Estimate], Optional[str]]:
    """(the estimate of the config's own layout on --gpus, None) — or (None, why not): the validation's one line,
    with the nearest split that validates where the cause is how the layers fall on the pipeline stages."""
    try:
        validate_layout(cfg, args.gpus, te_available=True, compute_capability=GPUS[args.gpu].compute_capability)
        return estimate(cfg, args.gpus, args.gpus_per_node, GPUS[args.gpu], model_vocab_size(cfg), args.mfu,
                        not args.bf16_grads), None
    except ConfigError as e:
        return None, str(e) + _nearest_stage_split(cfg, args, str(e))


def _nearest_stage_split(cfg: RecipeConfig, args: argparse.Namespace, error: str) -> str:
    """For a refusal about the pipeline stages' layers: the planner's near-even split at the config's PP (without
    virtual stages), when that one validates; else ''."""
    if "pipeline" not in error and "layers" not in error:
        return ""
    p = cfg.parallel
    first, last = pipeline_splits(cfg.model.num_layers, p.pipeline_model_parallel_size)[0]
    keys = [f"parallel.num_layers_in_first_pipeline_stage={'null' if first is None else first}",
            f"parallel.num_layers_in_last_pipeline_stage={'null' if last is None else last}",
            "parallel.virtual_pipeline_model_parallel_size=null"]
    try:
        validate_layout(dataclasses.replace(cfg, parallel=dataclasses.replace(
            p, num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            virtual_pipeline_model_parallel_size=None)), args.gpus, te_available=True,
            compute_capability=GPUS[args.gpu].compute_capability)
    except ConfigError:
        return ""
    return f" (the nearest split that validates at PP{p.pipeline_model_parallel_size}: {' '.join(keys)})"


def job_checkpoint_interval(cfg: RecipeConfig, args: argparse.Namespace, step_s: float) -> CheckpointInterval:
    return recipe_checkpoint_interval(cfg, args.gpus, step_s, model_vocab_size(cfg), args.checkpoint_write_gb_s,
                                      args.failures_per_gpu_hour, args.restart_s)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--published") for a in argv):  # its own command: every row of a published-runs CSV
        from recipes import plan_published

        return plan_published.main(argv)
    if any(a.startswith("--scaling") for a in argv):  # its own command: the recipe's model over GPU counts
        from recipes import plan_scaling

        return plan_scaling.main(argv)
    parser = argparse.ArgumentParser(prog="python -m recipes.plan", description=__doc__.splitlines()[0])
    add_job_arguments(parser)
    parser.add_argument("--top", type=int, default=10, help="layouts to list")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--markdown", action="store_true",
                        help="only the fastest layouts that fit, as a Markdown table (docs/planner.md's)")
    args = parser.parse_args(argv)
    try:
        cfg = load_job_config(args)
        ranked = plan(cfg, args.gpus, args.gpus_per_node, args.gpu, args.mfu, not args.bf16_grads)
        current, current_error = config_layout_estimate(cfg, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fitting = [e for e in ranked if e.fits]
    gpu = GPUS[args.gpu]
    ckpt_bytes = checkpoint_bytes(cfg, model_vocab_size(cfg))
    ckpt = {"bytes": ckpt_bytes, "write_gb_s": args.checkpoint_write_gb_s,
            "save_s": checkpoint_write_s(cfg, args.checkpoint_write_gb_s)}
    planned = current if current is not None and current.fits else (fitting[0] if fitting else None)
    interval = timeouts = None
    if planned is not None:
        interval = job_checkpoint_interval(cfg, args, planned.time["step"])
        ckpt["interval"] = interval.to_dict()
        timeouts = recipe_timeouts(cfg, planned.time["step"], args.checkpoint_write_gb_s)
    if args.markdown:
        print(_markdown(fitting[:args.top]))
        return 0 if fitting else 1
    if args.json:
        print(json.dumps({"gpus": args.gpus, "gpus_per_node": args.gpus_per_node, "gpu": args.gpu,
                          "valid_layouts": len(ranked), "fitting_layouts": len(fitting),
                          "train_iters": cfg.train.train_iters, "checkpoint": ckpt,
                          "timeouts": timeouts.to_dict() if timeouts else None,
                          "config_layout": current.to_dict() if current else None,
                          "config_layout_error": current_error,
                          "config_layout_time_to_train": (_time_to_train(current, cfg.train.train_iters, args.gpus)
                                                          if current else None),
                          "layouts": [{**e.to_dict(), "time_to_train": _time_to_train(e, cfg.train.train_iters,
                                                                                      args.gpus)}
                                      for e in fitting[:args.top]]}, indent=1))
        return 0 if fitting else 1
    m = cfg.model
    print(f"{cfg.recipe.name}: {m.num_layers} layers, h={m.hidden_size}, seq {m.seq_length}, global batch "
          f"{cfg.train.global_batch_size}, precision {cfg.train.precision} on {args.gpus}× {gpu.name} "
          f"({args.gpus_per_node}/node); " + _kernels_line(cfg, args.mfu, gpu))
    print(f"{len(ranked)} valid layouts, {len(fitting)} fit in {gpu.memory_gib:.0f} GiB "
          f"(with {100 * FRAGMENTATION:.0f} % allocator slack)\n")
    if not fitting:
        smallest = min(ranked, key=lambda e: e.memory["total"], default=None)
        if smallest:
            print(f"nothing fits; the smallest needs {smallest.memory['total'] / GIB:.1f} GiB: "
                  f"{smallest.layout.label()}")
        return 1
    moe = cfg.model.num_moe_experts is not None
    print(_table([_row(i + 1, e, moe) for i, e in enumerate(fitting[:args.top])], "fastest layouts that fit"))
    print()
    for i, e in enumerate(fitting[:3]):
        print(f"{i + 1}. {explain(e, gpu)}\n")
    if current_error is not None:
        print(f"the config's own layout has no estimate: {current_error}")
    if current is not None and current.layout != fitting[0].layout:
        rank = next((i + 1 for i, e in enumerate(ranked) if e.layout == current.layout), None)
        verdict = "fits" if current.fits else "does NOT fit"
        print(f"the config's own layout {Layout.of(cfg, args.gpus).label()}: "
              f"{current.time['step']:.2f} s/step, "
              f"{current.memory['total'] / GIB:.1f} GiB ({verdict}; "
              + (f"rank {rank} of {len(ranked)})" if rank else "outside the search)"))
    t = cfg.train
    tokens = t.train_iters * t.global_batch_size * m.seq_length
    print(f"\ntime to train train.train_iters={t.train_iters:,} × {t.global_batch_size:,} samples "
          f"({tokens / 1e9:,.1f} B tokens) on {args.gpus}× {gpu.name}, at the estimated step time: "
          + _say_time_to_train("best layout", fitting[0], t.train_iters, args.gpus)
          + ("; " + _say_time_to_train("the config's own", current, t.train_iters, args.gpus)
             if current is not None and current.layout != fitting[0].layout else ""))
    ck = cfg.checkpoint
    kept = f"keep_last={ck.keep_last}" if ck.keep_last else "every checkpoint kept (checkpoint.keep_last unset)"
    print(f"checkpoint: {ckpt_bytes / 1e9:,.0f} GB per save (weights and optimizer state); writing it at "
          f"{args.checkpoint_write_gb_s:g} GB/s takes {format_duration(ckpt['save_s'])} (asynchronous saves overlap "
          f"it with training); {kept}")
    if interval is not None:
        print(_say_interval(interval))
        print(f"timeouts: {timeouts.describe()}"
              + "".join(f"\n  warning: {w}" for w in timeout_warnings(timeouts, under_slurm=True)))
    best = " ".join(f"{k}={'null' if v is None else str(v).lower()}"
                    for k, v in fitting[0].overrides.items())
    print(f"\nto use the best: {best}")
    return 0


def _say_interval(i: CheckpointInterval) -> str:
    configured = (f"; the config's checkpoint.save_interval={i.configured_steps} gives "
                  f"{100 * i.configured_goodput:.1f} %" if i.configured_steps else
                  "; the config saves only at the end (checkpoint.save_interval unset)")
    return (f"checkpoint interval: every {i.steps:,} steps ({format_duration(i.interval_s)}) maximises the expected "
            f"goodput, {100 * i.goodput:.1f} % (Daly 2006), for a job MTBF of {format_duration(i.mtbf_s)} "
            f"({i.failures_per_gpu_hour:.2g} failures per GPU-hour), a {i.stall_s:.1f} s save stall"
            + (f" (asynchronous: the {format_duration(i.background_write_s)} write goes on in the background)"
               if i.background_write_s else "")
            + f" and a {format_duration(i.restart_s)} restart{configured}")


if __name__ == "__main__":
    sys.exit(main())
