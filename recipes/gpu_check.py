"""The GPU checklist in one command: ``make gpu-check`` (``python -m recipes.gpu_check [--out DIR] [--only NAME ...]``).

Everything this project wrote for GPUs but could only rehearse on CPU, run where a GPU is: the GPU-only tests
(CUDA graphs, liger kernels), the self-test (``recipes.doctor``: TE/FP8 where present, resume, HF round trip), the
benchmark sweep (every variant, including ``megatron-untimed`` for the step timers' cost), the fused linear
cross-entropy at a micro batch the unfused loss cannot hold, and a short run with the profiler and a CUDA memory
snapshot. Each step runs in its own process with its log under ``--out``; a step passes when it exits 0 **and** left
its evidence — no test skipped (a test that skips for want of TE or liger proves nothing), the benchmark's
results, the run's last step, the profiler's trace and snapshot — else it is INCOMPLETE, saying what is missing.
The summary gives each step's status, time and log, and what to copy into ``docs/`` (with the date, GPU and
versions it prints). Without a GPU it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron_ext.resilience.run_record import read_training_end

ROOT = Path(__file__).resolve().parents[1]
ONE_GPU_1B = ["--config", "configs/llama3_2_1b_1gpu_bf16.yaml", "data.mock=true", "checkpoint.save=null"]


# Given the step's log text and its output directory: what the step should have left and did not (None: all there).
Evidence = Callable[[str, Path], Optional[str]]


def nothing_skipped(log: str, out: Path) -> Optional[str]:
    """pytest's summary ran every test: a skipped one (no TE, no liger here) is not a pass."""
    skipped = re.findall(r"^SKIPPED \[\d+\] (.+)$", log, flags=re.M)
    if skipped or re.search(r"\d+ skipped", log):
        return f"{max(len(skipped), 1)} skipped: " + "; ".join(skipped)
    return None if re.search(r"\d+ passed", log) else "no test passed"


def no_check_skipped(log: str, out: Path) -> Optional[str]:
    """recipes.doctor's lines: a SKIP (no TransformerEngine, say) leaves that check unproven here."""
    skipped = re.findall(r"^SKIP +(.+?):", log, flags=re.M)
    return f"{len(skipped)} skipped: {', '.join(skipped)}" if skipped else None


def files(*patterns: str) -> Evidence:
    """Each glob pattern (under the output directory) matches a file."""
    def check(log: str, out: Path) -> Optional[str]:
        missing = [pattern for pattern in patterns if not any(out.glob(pattern))]
        return f"no {', '.join(missing)} under {out}" if missing else None
    return check


def finished(iterations: int, logs: str) -> Evidence:
    """The run's record (under its log directory `logs`, relative to the output directory) says it finished its
    last iteration."""
    def check(log: str, out: Path) -> Optional[str]:
        record = read_training_end(out / logs)
        return None if record and (record.ended, record.iteration) == ("finished", iterations) else \
            f"the run did not record finishing iteration {iterations} ({record or 'no record'})"
    return check


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    timeout_s: int
    what: str  # what it claims once it passes
    evidence: Evidence  # what it must leave behind to pass


def steps(out: Path) -> list[Step]:
    """The checklist, in the order it runs (cheap and most informative first)."""
    py = sys.executable
    pretrain = [py, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "recipes.pretrain", *ONE_GPU_1B]
    return [
        Step("gpu-tests", [py, "-m", "pytest", "-q", "-rs", "tests/integration/test_cuda_graphs.py",
                           "tests/integration/test_liger.py", "tests/integration/test_optimizer_offload_gpu.py",
                           "tests/integration/test_activation_offload_gpu.py",
                           "tests/integration/test_document_mask_gpu.py",
                           "tests/integration/test_te_interchange.py::test_real_transformer_engine_saves_the_golden_keys"],
             900,
             "CUDA graphs and liger kernels train like the eager/unfused paths; optimizer and activation CPU offload "
             "(with TE) train like the state kept on the GPU, the activations' with a lower peak; document masking's "
             "FlexAttention matches the dense mask and trains; real TE's checkpoint keys, dense and MoE (grouped "
             "experts), are the golden ones the TE-shaped stand-ins are tested against", nothing_skipped),
        Step("doctor", [py, "-m", "recipes.doctor", "--workdir", str(out / "doctor")], 900,
             "layer spec, FP8, resume and Hugging Face round trip on this GPU", no_check_skipped),
        Step("benchmark", [py, "-m", "recipes.benchmark", "--out-dir", str(out / "benchmark")], 1800,
             "tokens/s and MFU of every variant against the HF peers; the step timers' cost (megatron-untimed)",
             files("benchmark/benchmark.json")),
        Step("benchmark-moe", [py, "-m", "recipes.benchmark", "--preset", "moe", "--out-dir",
                               str(out / "benchmark-moe")], 1800,
             "the MoE preset (8 experts, top-2; grouped GEMM with TE) against transformers' MixtralForCausalLM",
             files("benchmark-moe/benchmark.json")),
        Step("fused-linear-ce", [*pretrain, "train.fused_linear_cross_entropy=true", "train.micro_batch_size=6",
                                 "train.global_batch_size=60", "train.train_iters=20",
                                 f"logging.log_dir={out / 'fused-linear-ce' / 'logs'}"], 900,
             "the fused output layer + loss at a micro batch the unfused loss cannot hold",
             finished(20, "fused-linear-ce/logs")),
        Step("profile", [*pretrain, "train.train_iters=6", "train.global_batch_size=8",
                         "logging.profile_steps=[4,5]", "logging.memory_snapshot=true",
                         f"logging.log_dir={out / 'profile' / 'logs'}"], 900,
             "a Perfetto trace and a CUDA memory snapshot of steps 4-5; the run summary's memory line vs the planner",
             files("profile/profile/rank-0.iter_4-5.json", "profile/profile/rank-0.iter_4-5.memory.pickle")),
    ]


def step_status(step: Step, code: Optional[int], log: str, out: Path) -> str:
    """PASS only for exit 0 with the step's evidence; INCOMPLETE (what is missing) for exit 0 without it."""
    if code is None:
        return "TIMEOUT"
    if code != 0:
        return f"FAIL (exit {code})"
    missing = step.evidence(log, out)
    return f"INCOMPLETE ({missing})" if missing else "PASS"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check", help="logs and results")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these steps")
    parser.add_argument("--list", action="store_true", help="print the steps and their commands, run nothing")
    args = parser.parse_args(argv)
    plan = [s for s in steps(args.out) if not args.only or s.name in args.only]
    if args.list:
        for step in plan:
            print(f"{step.name}: {' '.join(step.command)}\n  checks: {step.what}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no GPU here (torch.cuda.is_available() is False); run it where one is", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check on {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{time.strftime('%Y-%m-%d')}; logs in {args.out}", flush=True)
    results = []
    for step in plan:
        log = args.out / f"{step.name}.log"
        print(f"running {step.name} ({step.what})... log: {log}", flush=True)
        start = time.monotonic()
        with open(log, "w") as sink:
            try:
                code = subprocess.run(step.command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                      timeout=step.timeout_s).returncode
            except subprocess.TimeoutExpired:
                code = None
        status = step_status(step, code, log.read_text(errors="replace"), args.out)
        results.append((step, status, time.monotonic() - start, log))
        print(f"  {status} in {time.monotonic() - start:.0f} s", flush=True)
    print("\nsummary (copy the numbers into docs/ with the date, GPU and versions above):")
    for step, status, seconds, log in results:
        print(f"  {status:16} {step.name:16} {seconds:6.0f} s  {log}")
    return 0 if all(status == "PASS" for _, status, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
