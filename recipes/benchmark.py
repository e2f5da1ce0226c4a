"""Single-device training throughput: this recipe vs Hugging Face LlamaForCausalLM on the same shape.

    python -m recipes.benchmark                       # ~1B Llama, seq 4096, BF16 on a GPU
    python -m recipes.benchmark --preset tiny         # CPU-sized smoke run (what CI exercises)

Every variant runs in its own process (clean peak-memory numbers, no CPU-rehearsal patches
leaking into the peers) on the same model shape, micro batch, sequence length and random tokens:

* ``megatron``: recipes.pretrain's Trainer (megatron-core local layers + SDPA, or TE when present),
  eager; ``megatron-fused``: + megatron-core's fused SwiGLU and fused cross-entropy;
  ``megatron-compile``: local layers + torch.compile of every decoder layer (keys in MEGATRON_VARIANTS;
  the fused cross-entropy only in bf16, the one precision it is correct in);
* ``hf`` / ``hf-compile``: transformers LlamaForCausalLM, attn_implementation="sdpa", AdamW,
  without and with torch.compile.

Reported per variant: tokens/s, model TFLOP/s per device and MFU (metrics.flops_per_token on the
unpadded vocabulary for all variants: causal attention counted as current Megatron-LM does; the JSON also
has the PaLM-style figure without causal halving), peak memory. Output: a table, JSON and a PNG bar chart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

PRESETS = {
    # ~1.2B Llama-3.2-1B-like shape; the untied 32k vocabulary keeps the LM head from dominating.
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=8192, vocab_size=32000, seq_length=4096, micro_batch_size=1),
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=384, vocab_size=1024, seq_length=128, micro_batch_size=2),
}
FUSED_CROSS_ENTROPY = "train.fused_cross_entropy=true"  # bf16 only (megatron_ext.config rejects it in fp32)
# The recipe's kernel options, each a variant, so one run measures which of them pays off.
MEGATRON_VARIANTS = {
    "megatron": [],
    "megatron-fused": ["train.fused_swiglu=true", FUSED_CROSS_ENTROPY],
    # compile applies to megatron-core's local layers, also where TE is importable
    "megatron-compile": ["model.attention_backend=local", "train.compile=true", FUSED_CROSS_ENTROPY],
}
VARIANTS = (*MEGATRON_VARIANTS, "hf", "hf-compile")


@dataclass
class Result:
    variant: str
    device: str
    tokens_per_sec: float
    tflops_per_device: float
    mfu: Optional[float]  # attention counted over the causal half (current Megatron-LM)
    mfu_no_causal_halving: Optional[float]  # the full score matrix (PaLM-style), for older comparisons
    peak_memory_gb: Optional[float]
    step_time_s: float
    steps: int


def _shape_overrides(shape: dict, precision: str, steps: int) -> list[str]:
    model_keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "vocab_size", "seq_length")
    return [*(f"model.{k}={shape[k]}" for k in model_keys),
            "model.make_vocab_size_divisible_by=128",
            "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
            "parallel.sequence_parallel=false", "parallel.use_distributed_optimizer=false",
            f"train.micro_batch_size={shape['micro_batch_size']}", f"train.global_batch_size={shape['micro_batch_size']}",
            f"train.train_iters={steps}", f"train.eval_interval={steps + 1}", "train.eval_iters=0",
            f"train.precision={precision}", "data.mock=true", "data.blend=null", "data.tokenizer_model=null",
            "checkpoint.save=null", "logging.tensorboard_dir=null", f"logging.log_interval={steps}",
            "optimizer.lr_warmup_iters=0"]


def _recipe_config(shape: dict, precision: str, steps: int, variant: str = "megatron"):
    from megatron_ext.config import load_config

    kernels = [k for k in MEGATRON_VARIANTS[variant] if k != FUSED_CROSS_ENTROPY or precision == "bf16"]
    return load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                       [*_shape_overrides(shape, precision, steps), *kernels])


def _measure(variant: str, step_times: list[float], shape: dict, precision: str) -> Result:
    import torch

    from megatron_ext.metrics import flops_per_token, peak_tflops

    cfg = _recipe_config(shape, precision, len(step_times))
    step = statistics.median(step_times)
    tokens = shape["micro_batch_size"] * shape["seq_length"]
    tflops = flops_per_token(cfg, shape["vocab_size"]) * tokens / step / 1e12
    full_tflops = flops_per_token(cfg, shape["vocab_size"], causal=False) * tokens / step / 1e12
    peak = peak_tflops(cfg)
    on_gpu = torch.cuda.is_available()
    return Result(
        variant=variant, device=torch.cuda.get_device_name() if on_gpu else "cpu",
        tokens_per_sec=tokens / step, tflops_per_device=tflops, mfu=tflops / peak if peak else None,
        mfu_no_causal_halving=full_tflops / peak if peak else None,
        peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        step_time_s=step, steps=len(step_times),
    )


def run_megatron(variant: str, shape: dict, precision: str, warmup: int, steps: int) -> Result:
    from megatron_ext.training import pretrain

    result = pretrain(_recipe_config(shape, precision, warmup + steps, variant))
    return _measure(variant, result.step_times[warmup:], shape, precision)


def run_hf(shape: dict, precision: str, warmup: int, steps: int, compile_model: bool) -> Result:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    config = LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"], intermediate_size=shape["ffn_hidden_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_query_groups"], max_position_embeddings=shape["seq_length"],
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    forward = torch.compile(model) if compile_model else model
    tokens = torch.randint(0, shape["vocab_size"], (shape["micro_batch_size"], shape["seq_length"]), device=device)
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return _measure("hf-compile" if compile_model else "hf", times[warmup:], shape, precision)


def _run_variant_subprocess(variant: str, args: argparse.Namespace, out: Path) -> Result:
    cmd = [sys.executable, "-m", "recipes.benchmark", "--variant", variant, "--preset", args.preset,
           "--precision", args.precision, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--result-file", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return Result(**json.loads(out.read_text()))


def versions() -> dict[str, Optional[str]]:
    """What produced the numbers: a table is only comparable with one from the same stack."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> Optional[str]:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            **{name: installed(name) for name in ("megatron-core", "transformers", "transformer-engine")}}


def _table(results: list[Result]) -> str:
    header = f"{'variant':<16} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} {'step ms':>9}"
    rows = [header, "-" * len(header)]
    for r in results:
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        mem = f"{r.peak_memory_gb:.1f}" if r.peak_memory_gb is not None else "n/a"
        rows.append(f"{r.variant:<16} {r.tokens_per_sec:>12,.0f} {r.tflops_per_device:>9.2f} {mfu:>7} "
                    f"{mem:>9} {1000 * r.step_time_s:>9.1f}")
    return "\n".join(rows)


def _chart(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([r.variant for r in results], [r.tokens_per_sec for r in results],
                  color=["#76b900" if r.variant in MEGATRON_VARIANTS else "#888888" for r in results])
    ax.bar_label(bars, labels=[f"{r.tokens_per_sec:,.0f}" for r in results])
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model shape (default: 1b on a GPU, tiny on CPU)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="default: bf16 on a GPU, fp32 on CPU")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out-dir", default="runs/benchmark")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    on_gpu = torch.cuda.is_available()
    args.preset = args.preset or ("1b" if on_gpu else "tiny")
    args.precision = args.precision or ("bf16" if on_gpu else "fp32")
    shape = PRESETS[args.preset]

    if args.variant:  # child process: measure one variant, write its Result
        if args.variant in MEGATRON_VARIANTS:
            result = run_megatron(args.variant, shape, args.precision, args.warmup, args.steps)
        else:
            result = run_hf(shape, args.precision, args.warmup, args.steps, args.variant == "hf-compile")
        Path(args.result_file).write_text(json.dumps(asdict(result)))
        return 0

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.variants:
        print(f"benchmarking {variant} ({args.preset}, {args.precision}, {args.warmup}+{args.steps} steps)...",
              flush=True)
        results.append(_run_variant_subprocess(variant, args, out_dir / f"{variant}.json"))
    title = (f"{args.preset}: {shape['num_layers']}L h{shape['hidden_size']} seq {shape['seq_length']} "
             f"mbs {shape['micro_batch_size']} {args.precision} on {results[0].device}")
    table = _table(results)
    print(f"\n{title}\n{table}")
    record = {"title": title, "shape": shape, "precision": args.precision, "versions": versions(),
              "results": [asdict(r) for r in results]}
    (out_dir / "benchmark.json").write_text(json.dumps(record, indent=1) + "\n")
    _chart(results, out_dir / "benchmark.png", title)
    def fastest(rs: list[Result]) -> Optional[Result]:
        return max(rs, key=lambda r: r.tokens_per_sec, default=None)

    ours = fastest([r for r in results if r.variant in MEGATRON_VARIANTS])
    best_peer = fastest([r for r in results if r.variant not in MEGATRON_VARIANTS])
    if ours and best_peer:
        print(f"\nbest recipe variant ({ours.variant}) vs best peer ({best_peer.variant}): "
              f"{ours.tokens_per_sec / best_peer.tokens_per_sec:.2f}×")
    print(f"wrote {out_dir / 'benchmark.json'} and {out_dir / 'benchmark.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
