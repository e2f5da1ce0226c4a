"""Checkpoint save/load cost of each distributed-optimizer format, at several data-parallel sizes.

    python -m recipes.benchmark_checkpoint                 # DP 4 and 8 on this machine, a ~120M-parameter model
    python -m recipes.benchmark_checkpoint --dp-sizes 8 --formats dp_reshardable fully_reshardable

Each DP size is one torchrun job of the recipe's Trainer (distributed optimizer; fp32 in CPU rehearsal, bf16 on
GPUs). It takes one training step so the Adam state exists, then saves and loads back each format in turn
(synchronously, under --out-dir). Measured per format: save and load wall time (slowest rank), how much the
resident memory of DP rank 0 and of the worst rank grows during the save and the load (sampled every 5 ms),
the checkpoint size, and whether the loaded optimizer state equals the saved one. Output: a table and
``benchmark_checkpoint.json``; docs/performance.md records the measured numbers behind the default format.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    # ~120M parameters: 1.4 GB of fp32 weights + Adam state, seconds to write on a laptop disk.
    "120m": dict(num_layers=8, hidden_size=768, num_attention_heads=12, num_query_groups=4, ffn_hidden_size=2048),
    # ~55M: the same at a size whose DP-8 run (8 model replicas + gathered state) fits a 24 GiB machine.
    "55m": dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1408),
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=384),
}


@dataclass
class FormatResult:
    optimizer_format: str
    dp: int
    save_s: float
    load_s: float
    save_rss_growth_rank0_gb: float
    save_rss_growth_max_gb: float
    load_rss_growth_rank0_gb: float
    load_rss_growth_max_gb: float
    size_gb: float
    load_matches: bool


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Peak resident-memory growth of this process while the block runs (a sampling thread)."""

    def __enter__(self) -> "_PeakRss":
        self.base = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def growth_gb(self) -> float:
        return (self.peak - self.base) / 2**30


def _overrides(shape: dict, dp: int) -> list[str]:
    return [*(f"model.{k}={v}" for k, v in shape.items()), "model.seq_length=128",
            "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
            "parallel.sequence_parallel=false", "parallel.use_distributed_optimizer=true",
            "train.micro_batch_size=1", f"train.global_batch_size={dp}", "train.train_iters=1", "train.eval_iters=0",
            "data.mock=true", "data.blend=null", "data.tokenizer_model=null", "model.vocab_size=32000",
            "checkpoint.save=null", "logging.tensorboard_dir=null"]


def _adam_state_tensors(optimizer) -> list:
    import torch

    return [value for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for state in opt.optimizer.state.values() for value in state.values()
            if torch.is_tensor(value) and value.is_floating_point()]


def _optimizer_fingerprint(optimizer) -> float:
    """A sum over every Adam state tensor of this rank: equal before save and after load when the load is right."""
    return sum(float(t.double().abs().sum()) for t in _adam_state_tensors(optimizer))


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from megatron_ext.checkpoint import layout, save_load
    from megatron_ext.checkpoint.common_state import read_common
    from megatron_ext.config.schema import load_config
    from megatron_ext.training.trainer import Trainer

    dp = int(os.environ["WORLD_SIZE"])
    cfg = load_config(ROOT / "configs" / "tiny.yaml", _overrides(SHAPES[args.shape], dp))
    trainer = Trainer(cfg)
    trainer.train_step(trainer.data.iterators(trainer.data.train))
    reference = _optimizer_fingerprint(trainer.optimizer)
    # Untimed: the first save starts dist_checkpointing's helper processes and caches, whatever the format.
    warmup = Path(args.out_dir) / f"ckpt-dp{dp}-warmup"
    save_load.save_checkpoint(warmup, 1, trainer.model, trainer.optimizer, trainer.scheduler, dp, cfg.to_dict(),
                              optimizer_format=args.formats[0])
    if dist.get_rank() == 0:
        shutil.rmtree(warmup)
    results = []
    for fmt in args.formats:
        root = Path(args.out_dir) / f"ckpt-dp{dp}-{fmt}"
        dist.barrier()
        start = time.perf_counter()
        with _PeakRss() as save_mem:
            save_load.save_checkpoint(root, 1, trainer.model, trainer.optimizer, trainer.scheduler, dp,
                                      cfg.to_dict(), optimizer_format=fmt)
        save_s = time.perf_counter() - start
        ckpt_dir = layout.iteration_dir(root, 1)
        with torch.no_grad():
            for tensor in _adam_state_tensors(trainer.optimizer):  # a load that skips one must fail the check
                tensor.zero_()
        common = read_common(ckpt_dir)
        dist.barrier()
        start = time.perf_counter()
        with _PeakRss() as load_mem:
            save_load.load_training_state(ckpt_dir, common, trainer.model, trainer.optimizer, trainer.scheduler,
                                          cfg.to_dict())
        load_s = time.perf_counter() - start
        matches = abs(_optimizer_fingerprint(trainer.optimizer) - reference) <= 1e-9 * max(reference, 1.0)
        row = [save_s, load_s, save_mem.growth_gb, load_mem.growth_gb, float(matches)]
        rows: list[Optional[list[float]]] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            size = sum(f.stat().st_size for f in ckpt_dir.rglob("*") if f.is_file())
            results.append(FormatResult(
                optimizer_format=fmt, dp=dp, save_s=max(r[0] for r in rows), load_s=max(r[1] for r in rows),
                save_rss_growth_rank0_gb=rows[0][2], save_rss_growth_max_gb=max(r[2] for r in rows),
                load_rss_growth_rank0_gb=rows[0][3], load_rss_growth_max_gb=max(r[3] for r in rows),
                size_gb=size / 2**30, load_matches=all(r[4] for r in rows)))
            shutil.rmtree(root)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.result_file).write_text(json.dumps([asdict(r) for r in results]))
    dist.destroy_process_group()


def _table(results: list[FormatResult]) -> str:
    header = (f"{'DP':>3} {'optimizer format':<32} {'save s':>7} {'load s':>7} {'save +GiB r0/max':>17} "
              f"{'load +GiB r0/max':>17} {'GiB':>6} {'exact':>6}")
    rows = [header, "-" * len(header)]
    for r in results:
        rows.append(f"{r.dp:>3} {r.optimizer_format:<32} {r.save_s:>7.2f} {r.load_s:>7.2f} "
                    f"{r.save_rss_growth_rank0_gb:>8.2f}/{r.save_rss_growth_max_gb:<8.2f} "
                    f"{r.load_rss_growth_rank0_gb:>8.2f}/{r.load_rss_growth_max_gb:<8.2f} {r.size_gb:>6.2f} "
                    f"{'yes' if r.load_matches else 'NO':>6}")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_ext.config.schema import OPTIMIZER_FORMATS

    parser = argparse.ArgumentParser(prog="python -m recipes.benchmark_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp-sizes", type=int, nargs="+", default=[4, 8])
    formats = [f for f in OPTIMIZER_FORMATS if f != "auto"]
    parser.add_argument("--formats", nargs="+", choices=formats, default=formats)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="120m")
    parser.add_argument("--out-dir", default="runs/benchmark_checkpoint")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one torchrun rank
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[FormatResult] = []
    for dp in args.dp_sizes:
        print(f"DP {dp}: {args.shape} model, formats {', '.join(args.formats)}...", flush=True)
        result_file = out_dir / f"dp{dp}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}",
               "-m", "recipes.benchmark_checkpoint", "--worker", "--shape", args.shape, "--formats", *args.formats,
               "--out-dir", str(out_dir.resolve()), "--result-file", str(result_file.resolve())]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"DP {dp} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            return 1
        results.extend(FormatResult(**r) for r in json.loads(result_file.read_text()))
    from recipes.benchmark import versions

    table = _table(results)
    print(f"\n{table}")
    record = {"shape": {**SHAPES[args.shape], "vocab_size": 32000}, "machine": f"{os.cpu_count()} CPUs",
              "versions": versions(), "results": [asdict(r) for r in results]}
    (out_dir / "benchmark_checkpoint.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out_dir / 'benchmark_checkpoint.json'}")
    return 0 if all(r.load_matches for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
