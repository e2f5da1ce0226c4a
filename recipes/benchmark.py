"""Single-device training throughput: this recipe vs Hugging Face transformers on the same model, per micro batch.

    python -m recipes.benchmark                                  # ~1B Llama, seq 4096, BF16 on a GPU, mbs 1 2 4
    python -m recipes.benchmark --seq-length 16384 --micro-batch-sizes 1
    python -m recipes.benchmark --preset moe                     # Mixtral-style MoE (8 experts, top-2) vs Mixtral
    python -m recipes.benchmark --preset deepseek                # DeepSeek-V3-style (MLA, 32 experts) vs DeepseekV3
    python -m recipes.benchmark --preset tiny                    # CPU-sized smoke run (what CI exercises)

Every (variant, micro batch) runs in its own process (clean peak-memory numbers, no CPU-rehearsal patches
leaking into the peers) on the same model shape, sequence length and tokens (the recipe's mock data, fed to the
peers batch by batch: an MoE layer's routing, hence its speed, depends on them). The peer is the transformers class
the recipe exports to (``LlamaForCausalLM``; ``MixtralForCausalLM`` with its load-balancing loss for an MoE preset;
``DeepseekV3ForCausalLM`` for a DeepSeek preset),
built from the exporter's config.json for the recipe's shape. Variants, by precision
regime (fp32 runs: every variant is plain fp32):

* ``megatron-eager``: recipes.pretrain's Trainer, eager (TransformerEngine layers where TE imports, else
  megatron-core's local layers + SDPA); fp32 master weights and grads, bf16 compute;
* ``megatron-compile``: local layers + torch.compile of every decoder layer (the default on a GPU without TE);
* ``megatron-fp8``: TE layers + FP8 (delayed scaling) compute, fp32 master weights; only where TE imports
  on an FP8-capable GPU, otherwise reported as skipped;
* ``megatron-cudagraph``: local layers, eager, each captured as a megatron-core CUDA graph
  (``train.cuda_graph_impl=local``); only on a GPU, otherwise reported as skipped;
* ``megatron-liger``: ``megatron-compile`` with liger-kernel's Triton RMSNorm and SwiGLU (``train.liger_kernels``)
  and its fused linear cross-entropy, which never materialises the logits (``train.fused_linear_cross_entropy``);
  only on a GPU with liger-kernel installed, otherwise reported as skipped;
  (every megatron variant uses the recipe's default kernels: fused cross-entropy in bf16);
* ``hf`` / ``hf-compile``: transformers, pure bf16 — bf16 weights and bf16 AdamW state, no fp32 master copy:
  cheaper per step and numerically weaker (updates below bf16's resolution are lost);
* ``hf-amp`` / ``hf-amp-compile``: transformers as HF Trainer ``bf16=True`` runs it — fp32 weights, bf16
  autocast, fused AdamW; the like-for-like peer of the recipe's regime.

All use ``attn_implementation="sdpa"`` / the same attention kernels SDPA picks. Reported per run: tokens/s,
model TFLOP/s per device and MFU (ModelShape.flops_per_token on the unpadded vocabulary for every variant:
causal attention counted as current Megatron-LM does; the JSON also has the PaLM-style figure without causal
halving), peak memory. The closing lines give, per micro batch, the fastest recipe variant against the fastest
peer with the same master-weight regime and against the fastest peer overall. Output: a table, JSON and a PNG
chart grouped by micro batch.
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

# DeepSeek-V3's norm epsilon: transformers' DeepseekV3 norms the compressed query and KV with it whatever its config says
_MLA = dict(multi_latent_attention=True, num_query_groups=None, layernorm_epsilon=1e-6)
_DEEPSEEK_ROUTER = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4)
PRESETS = {  # a preset's model.* keys, and the micro batch sizes it runs
    # ~1.2B Llama-3.2-1B-like shape; the untied 32k vocabulary keeps the LM head from dominating.
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=8192, vocab_size=32000, seq_length=4096, micro_batch_sizes=[1, 2, 4]),
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=384, vocab_size=1024, seq_length=128, micro_batch_sizes=[2]),
    # Mixtral-style MoE, 1.8B parameters of which 0.6B active (8 SwiGLU experts, top-2, aux-loss balancing) on
    # one GPU: the peer is transformers' MixtralForCausalLM with its load-balancing loss on
    "moe": dict(num_layers=8, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=4096,
                num_moe_experts=8, moe_router_topk=2, vocab_size=32000, seq_length=4096, micro_batch_sizes=[1, 2]),
    "moe-tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
                     num_moe_experts=4, moe_router_topk=2, vocab_size=1024, seq_length=128, micro_batch_sizes=[2]),
    # DeepSeek-V3-style, 1.33B parameters of which 0.40B active on one GPU (multi-latent attention, a first dense
    # layer, 32 fine-grained experts top-4 from the best 2 of 4 groups + a shared expert, sigmoid routing with the
    # expert bias): the peer is transformers' DeepseekV3ForCausalLM
    "deepseek": dict(num_layers=8, hidden_size=2048, num_attention_heads=16, **_MLA, q_lora_rank=512, kv_lora_rank=256,
                     qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, ffn_hidden_size=6144,
                     moe_layer_freq=[0] + [1] * 7, num_moe_experts=32, moe_router_topk=4, moe_ffn_hidden_size=768,
                     moe_shared_expert_intermediate_size=768, moe_router_num_groups=4, moe_router_group_topk=2,
                     moe_router_topk_scaling_factor=2.5, **_DEEPSEEK_ROUTER, vocab_size=32000, seq_length=4096,
                     micro_batch_sizes=[1, 2]),
    "deepseek-tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, **_MLA, q_lora_rank=32,
                          kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, ffn_hidden_size=256,
                          moe_layer_freq=[0, 1], num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                          moe_shared_expert_intermediate_size=64, moe_router_num_groups=2, moe_router_group_topk=1,
                          moe_router_topk_scaling_factor=2.5, **_DEEPSEEK_ROUTER, vocab_size=1024, seq_length=128,
                          micro_batch_sizes=[2]),
}
# The recipe's kernel choices, each a variant, so one run measures which of them pays off.
MEGATRON_VARIANTS = {
    "megatron-eager": ["train.compile=false"],
    # the same without the per-step breakdown's timers: what timing every region costs
    "megatron-untimed": ["train.compile=false", "logging.step_breakdown=false"],
    "megatron-compile": ["model.attention_backend=local", "train.compile=true"],
    "megatron-fp8": ["model.attention_backend=te", "train.compile=false", "train.fp8=delayed"],
    "megatron-cudagraph": ["model.attention_backend=local", "train.compile=false", "train.cuda_graph_impl=local"],
    "megatron-liger": ["model.attention_backend=local", "train.compile=true", "train.liger_kernels=true",
                       "train.fused_linear_cross_entropy=true"],
    # document masking (FlexAttention's block mask on a GPU) against megatron-compile's plain causal attention
    "megatron-docmask": ["model.attention_backend=local", "train.compile=true", "data.reset_attention_mask=true",
                         "data.reset_position_ids=true"],
}
HF_VARIANTS = {  # name: (fp32 master weights + autocast, torch.compile)
    "hf": (False, False), "hf-compile": (False, True), "hf-amp": (True, False), "hf-amp-compile": (True, True),
}
VARIANTS = (*MEGATRON_VARIANTS, *HF_VARIANTS)


def regime(variant: str, precision: str) -> tuple[str, str]:
    """(master-weight precision, a description of the variant's precision regime)."""
    if precision == "fp32":
        return "fp32", "fp32 weights and compute"
    if variant == "megatron-fp8":
        return "fp32", "fp32 master weights, FP8 compute"
    if variant in MEGATRON_VARIANTS or HF_VARIANTS[variant][0]:
        return "fp32", "fp32 master weights, bf16 compute"
    return "bf16", "pure bf16: bf16 weights and Adam state"


def unavailable(variant: str, shape: dict, precision: str, te_available: bool,
                compute_capability: Optional[tuple[int, int]], on_gpu: bool) -> Optional[str]:
    """Why `variant` cannot run here, or None: for a recipe variant, the recipe's own config rules for this
    machine (validation, then the kernel options it would resolve)."""
    if variant in HF_VARIANTS:
        if HF_VARIANTS[variant][0] and precision != "bf16":
            return "autocast regime: bf16 only (in fp32 `hf` is the same regime as the recipe)"
        return None
    from megatron_ext.config.kernels import resolve_kernel_options, uses_transformer_engine
    from megatron_ext.config.validate import validate_layout
    from megatron_ext.errors import ConfigError

    cfg = recipe_config({**shape, "micro_batch_size": 1}, precision, steps=1, variant=variant)
    try:
        validate_layout(cfg, world_size=1, te_available=te_available, compute_capability=compute_capability)
        resolve_kernel_options(cfg, on_gpu, uses_transformer_engine(cfg, on_gpu, te_available))
    except ConfigError as e:
        return str(e)
    return None


@dataclass
class Result:
    variant: str
    micro_batch_size: int
    seq_length: int
    master_weights: str  # fp32 | bf16: the comparison classes
    regime: str
    device: str
    tokens_per_sec: float
    tflops_per_device: float
    mfu: Optional[float]  # attention counted over the causal half (current Megatron-LM)
    mfu_no_causal_halving: Optional[float]  # the full score matrix (PaLM-style), for older comparisons
    peak_memory_gb: Optional[float]
    step_time_s: float
    steps: int


def _override(value: object) -> str:
    return "null" if value is None else str(value).replace(" ", "")


def _shape_overrides(shape: dict, precision: str, steps: int) -> list[str]:
    return [*(f"model.{k}={_override(v)}" for k, v in shape.items() if k != "micro_batch_size"),
            "model.make_vocab_size_divisible_by=128",
            "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
            "parallel.sequence_parallel=false", "parallel.use_distributed_optimizer=false",
            f"train.micro_batch_size={shape['micro_batch_size']}",
            f"train.global_batch_size={shape['micro_batch_size']}",
            f"train.train_iters={steps}", f"train.eval_interval={steps + 1}", "train.eval_iters=0",
            f"train.precision={precision}", "data.mock=true", "data.blend=null", "data.tokenizer_model=null",
            "checkpoint.save=null", "logging.tensorboard_dir=null", f"logging.log_interval={steps}",
            "optimizer.lr_warmup_iters=0"]


def recipe_config(shape: dict, precision: str, steps: int, variant: str = "megatron-eager"):
    """The recipe config a megatron variant trains (`shape` with one micro_batch_size)."""
    from megatron_ext.config.schema import load_config

    return load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                       [*_shape_overrides(shape, precision, steps), *MEGATRON_VARIANTS[variant]])


def _measure(variant: str, step_times: list[float], shape: dict, precision: str) -> Result:
    import torch

    from megatron_ext.config.shape import ModelShape
    from megatron_ext.metrics.run_logger import peak_tflops

    cfg = recipe_config(shape, precision, len(step_times))
    step = statistics.median(step_times)
    tokens = shape["micro_batch_size"] * shape["seq_length"]
    model = ModelShape.of(cfg.model)
    tflops = model.flops_per_token(shape["vocab_size"]) * tokens / step / 1e12
    full_tflops = model.flops_per_token(shape["vocab_size"], causal=False) * tokens / step / 1e12
    peak = peak_tflops(cfg)
    on_gpu = torch.cuda.is_available()
    master, description = regime(variant, precision)
    return Result(
        variant=variant, micro_batch_size=shape["micro_batch_size"], seq_length=shape["seq_length"],
        master_weights=master, regime=description, device=torch.cuda.get_device_name() if on_gpu else "cpu",
        tokens_per_sec=tokens / step, tflops_per_device=tflops, mfu=tflops / peak if peak else None,
        mfu_no_causal_halving=full_tflops / peak if peak else None,
        peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        step_time_s=step, steps=len(step_times),
    )


def run_megatron(variant: str, shape: dict, precision: str, warmup: int, steps: int) -> Result:
    from megatron_ext.training.trainer import pretrain

    result = pretrain(recipe_config(shape, precision, warmup + steps, variant))
    return _measure(variant, result.step_times[warmup:], shape, precision)


def recipe_batches(cfg, count: int) -> list[dict]:
    """The first `count` micro batches the recipe trains on (its mock data at one DP rank), for the peers."""
    from megatron_ext.data.datasets import build_datasets, microbatch_iterator
    from megatron_ext.data.tokenizer import VocabOnlyTokenizer

    train, _, _ = build_datasets(cfg, VocabOnlyTokenizer(cfg.model.vocab_size))
    batches = microbatch_iterator(train, 0, cfg.train.micro_batch_size, dp_rank=0, dp_size=1, num_workers=0)
    return [next(batches) for _ in range(count)]


def hf_model(cfg, dtype):
    """The transformers model of the recipe's shape, built from the exporter's config.json for it (Llama; for an
    MoE recipe Mixtral with its load-balancing loss on, as the recipe trains with megatron-core's aux loss; with
    multi-latent attention DeepSeek-V3, whose router balances by its bias alone)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_ext.convert import families

    shape = families.shape_from_recipe(cfg, cfg.model.vocab_size)
    fields = families.family_of(shape).hf_config(shape, torch.float32, bos_id=None, eos_id=None)
    if shape.model_type == "mixtral":
        fields["output_router_logits"] = True
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype=dtype)


def run_hf(variant: str, shape: dict, precision: str, warmup: int, steps: int) -> Result:
    import contextlib

    import torch

    amp, compile_model = HF_VARIANTS[variant]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = recipe_config(shape, precision, warmup + steps)
    # pure bf16 keeps the weights (hence AdamW's state) in bf16; amp keeps them fp32 and autocasts the compute
    model = hf_model(cfg, torch.bfloat16 if precision == "bf16" and not amp else torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    forward = torch.compile(model) if compile_model else model
    times = []
    for batch in recipe_batches(cfg, warmup + steps):  # the tokens the recipe trains on (MoE routing depends on them)
        tokens = batch["tokens"].to(device)
        start = time.perf_counter()
        autocast = torch.autocast(device, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
        with autocast:
            loss = forward(input_ids=tokens, labels=tokens).loss  # transformers shifts: the recipe's labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return _measure(variant, times[warmup:], shape, precision)


def _run_in_subprocess(variant: str, mbs: int, args: argparse.Namespace, out: Path) -> Result:
    cmd = [sys.executable, "-m", "recipes.benchmark", "--variant", variant, "--preset", args.preset,
           "--precision", args.precision, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--micro-batch-sizes", str(mbs), "--seq-length", str(args.seq_length), "--result-file", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} at micro batch {mbs} failed:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
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
    header = (f"{'mbs':>3} {'variant':<16} {'regime':<36} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
              f"{'peak GiB':>8} {'step ms':>8}")
    rows = [header, "-" * len(header)]
    for r in sorted(results, key=lambda r: r.micro_batch_size):
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        mem = f"{r.peak_memory_gb:.1f}" if r.peak_memory_gb is not None else "n/a"
        rows.append(f"{r.micro_batch_size:>3} {r.variant:<16} {r.regime:<36} {r.tokens_per_sec:>10,.0f} "
                    f"{r.tflops_per_device:>8.2f} {mfu:>6} {mem:>8} {1000 * r.step_time_s:>8.1f}")
    return "\n".join(rows)


def _fastest(results: list[Result]) -> Optional[Result]:
    return max(results, key=lambda r: r.tokens_per_sec, default=None)


def comparisons(results: list[Result]) -> list[dict]:
    """Per micro batch: the fastest recipe variant against the fastest peer of its master-weight regime and
    against the fastest peer overall."""
    rows = []
    for mbs in sorted({r.micro_batch_size for r in results}):
        at = [r for r in results if r.micro_batch_size == mbs]
        ours = _fastest([r for r in at if r.variant in MEGATRON_VARIANTS])
        peers = [r for r in at if r.variant in HF_VARIANTS]
        if ours is None or not peers:
            continue
        row = {"micro_batch_size": mbs, "recipe": ours.variant}
        for key, candidates in (("same_regime", [r for r in peers if r.master_weights == ours.master_weights]),
                                ("overall", peers)):
            peer = _fastest(candidates)
            row[key] = {"peer": peer.variant, "ratio": ours.tokens_per_sec / peer.tokens_per_sec} if peer else None
        rows.append(row)
    return rows


def timer_overhead(results: list[Result]) -> dict[int, float]:
    """Per micro batch: how much longer a step takes with the step-breakdown timers (megatron-eager) than without
    (megatron-untimed), as a fraction."""
    times = {(r.variant, r.micro_batch_size): r.step_time_s for r in results}
    return {mbs: times["megatron-eager", mbs] / times["megatron-untimed", mbs] - 1
            for variant, mbs in times if variant == "megatron-untimed" and ("megatron-eager", mbs) in times}


def _chart(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.micro_batch_size for r in results})
    variants = [v for v in VARIANTS if any(r.variant == v for r in results)]
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(2 + 1.2 * len(sizes) * max(1, len(variants) / 3), 3.8))
    for i, variant in enumerate(variants):
        points = [(sizes.index(r.micro_batch_size), r.tokens_per_sec) for r in results if r.variant == variant]
        bars = ax.bar([x + (i - (len(variants) - 1) / 2) * width for x, _ in points], [y for _, y in points], width,
                      label=variant, color=plt.cm.Greens(0.4 + 0.5 * i / len(variants)) if variant in
                      MEGATRON_VARIANTS else plt.cm.Greys(0.3 + 0.5 * i / len(variants)))
        ax.bar_label(bars, labels=[f"{y / 1000:.0f}k" for _, y in points], fontsize=6)
    ax.set_xticks(range(len(sizes)), [f"micro batch {s}" for s in sizes])
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncols=2)
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
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=None,
                        help="each one a separate run of every variant (default: the preset's)")
    parser.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out-dir", default="runs/benchmark")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one run
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    on_gpu = torch.cuda.is_available()
    args.preset = args.preset or ("1b" if on_gpu else "tiny")
    args.precision = args.precision or ("bf16" if on_gpu else "fp32")
    preset = dict(PRESETS[args.preset])
    sizes = args.micro_batch_sizes or preset.pop("micro_batch_sizes")
    preset.pop("micro_batch_sizes", None)
    args.seq_length = args.seq_length or preset["seq_length"]
    shape = {**preset, "seq_length": args.seq_length}

    if args.variant:  # child process: measure one variant at one micro batch, write its Result
        one = {**shape, "micro_batch_size": sizes[0]}
        if args.variant in MEGATRON_VARIANTS:
            result = run_megatron(args.variant, one, args.precision, args.warmup, args.steps)
        else:
            result = run_hf(args.variant, one, args.precision, args.warmup, args.steps)
        Path(args.result_file).write_text(json.dumps(asdict(result)))
        return 0

    from megatron_ext.model.llama import gpu_compute_capability, transformer_engine_available

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, skipped = [], {}
    for variant in args.variants:
        reason = unavailable(variant, shape, args.precision, transformer_engine_available(), gpu_compute_capability(),
                             on_gpu)
        if reason:
            skipped[variant] = reason
            print(f"skipping {variant}: {reason}", flush=True)
            continue
        for mbs in sizes:
            print(f"benchmarking {variant} at micro batch {mbs} ({args.preset}, seq {args.seq_length}, "
                  f"{args.precision}, {args.warmup}+{args.steps} steps)...", flush=True)
            results.append(_run_in_subprocess(variant, mbs, args, out_dir / f"{variant}-mbs{mbs}.json"))
    if not results:
        print("nothing ran", file=sys.stderr)
        return 1
    experts = (f" {shape['num_moe_experts']} experts top-{shape['moe_router_topk']}" if "num_moe_experts" in shape
               else "")
    title = (f"{args.preset}: {shape['num_layers']}L h{shape['hidden_size']}{experts} seq {args.seq_length} "
             f"{args.precision} on {results[0].device}")
    print(f"\n{title}\n{_table(results)}")
    compared = comparisons(results)
    for row in compared:
        labels = (("same_regime", "vs the fastest peer of its master-weight regime"),
                  ("overall", "vs the fastest peer"))
        parts = [f"{label} ({row[key]['peer']}) {row[key]['ratio']:.2f}×" for key, label in labels if row[key]]
        print(f"micro batch {row['micro_batch_size']}: {row['recipe']} " + "; ".join(parts))
    overhead = timer_overhead(results)
    for mbs, fraction in overhead.items():
        print(f"micro batch {mbs}: the step-breakdown timers cost {100 * fraction:+.1f}% step time "
              f"(megatron-eager vs megatron-untimed)")
    record = {"title": title, "shape": shape, "micro_batch_sizes": sizes, "precision": args.precision,
              "versions": versions(), "results": [asdict(r) for r in results], "skipped": skipped,
              "comparisons": compared, "timer_overhead": overhead}
    (out_dir / "benchmark.json").write_text(json.dumps(record, indent=1) + "\n")
    _chart(results, out_dir / "benchmark.png", title)
    print(f"wrote {out_dir / 'benchmark.json'} and {out_dir / 'benchmark.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
