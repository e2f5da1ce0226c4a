"""Self-test for a new machine or container: ``python -m recipes.doctor [--workdir DIR] [--json FILE]``.

Prints one PASS / FAIL / SKIP line per check, with the reason, and a summary; paste it into a bug report.
It checks the package versions against the pinned/declared ranges, the GPU and NCCL, and then trains a
2-layer model for 5 steps with the layer spec this machine picks (TransformerEngine when it imports on a
GPU, with FP8 where the GPU has it), stops and resumes it (same losses), round-trips it through the
Hugging Face format (export, import, train from the import) and, with TE, moves checkpoints both ways
between the TE and the local layer spec. On CPU (gloo, fp32) it runs what the CPU allows and says what it
skipped. Exit status: 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
# megatron-core 0.19 declares no TransformerEngine range (its [te] extra is unbounded): 2.14 is the newest release its
# code checks for, 2.17 the one its CI builds and the NGC 26.07 image (the Dockerfile's base) ships.
TE_RANGE = ("2.14.0", "2.18.0")
STEPS, STOP = 5, 3
# How close a continued run must stay to the uninterrupted one (relative, per step). CPU: fp32 and
# deterministic, the parity matrix's bound. GPU: bf16; an H100 reproduced its losses exactly on resume,
# the bound leaves room for attention kernels that are not bitwise reproducible. Across layer specs the
# kernels differ (TE's fused norm+GEMM and cuDNN attention vs torch's): measured 2e-4 (local -> TE) and
# 5e-6 (TE -> local) on an H100 with TE 2.11; a resume that lost the Adam state is off by far more.
SAME_SPEC = {"cpu": 1e-6, "gpu": 1e-3}
CROSS_SPEC = 5e-3

@dataclass
class Check:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str


@dataclass
class Machine:
    gpu: bool
    te: bool
    compute_capability: Optional[tuple[int, int]]  # the GPU's; None without one

    @property
    def fp8(self) -> bool:
        """TransformerEngine's FP8 recipe the doctor trains with (delayed scaling) runs on this GPU."""
        from megatron_ext.config.precision import LOW_PRECISION_GPUS

        return LOW_PRECISION_GPUS["delayed"].holds(self.compute_capability)


def pinned(requirements: str, package: str) -> str:
    """The version `requirements` (a file at the top of the repository) pins `package` to."""
    for line in (ROOT / requirements).read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name == package:
            return version
    raise KeyError(f"{requirements} pins no {package}")


def _version(module: str) -> Optional[str]:
    try:
        return __import__(module, fromlist=["__version__"]).__version__
    except Exception:  # not installed, or broken at import
        return None


def check_versions(machine: Machine) -> list[Check]:
    from packaging.version import Version

    checks = []
    # (megatron.core.__version__ carries the git hash of the checkout it runs in: compare the release alone)
    mcore, wanted = _version("megatron.core"), pinned("requirements.txt", "megatron-core")
    checks.append(Check("megatron-core", "PASS" if mcore and mcore.split("+")[0] == wanted else "FAIL",
                        f"{mcore} (requirements.txt pins {wanted})"))
    torch_version = _version("torch")
    if machine.gpu:
        checks.append(Check("torch", "PASS", f"{torch_version} (the GPU build this machine brings; not pinned)"))
    else:
        wanted = pinned("requirements-torch.txt", "torch")
        ok = torch_version and torch_version.split("+")[0] == wanted
        checks.append(Check("torch", "PASS" if ok else "FAIL",
                            f"{torch_version} (requirements-torch.txt pins {wanted} where no GPU build is brought)"))
    te = _version("transformer_engine")
    if te is None:
        checks.append(Check("TransformerEngine", "SKIP", "not installed: local layers (megatron-core + torch SDPA)"))
    else:
        low, high = TE_RANGE
        inside = Version(low) <= Version(te.split("+")[0]) < Version(high)
        usable = " and usable by megatron-core" if machine.te else ", but megatron-core cannot use it (see TE spec)"
        checks.append(Check("TransformerEngine", "PASS" if inside and machine.te else "FAIL",
                            f"{te} (megatron-core 0.19's code checks TE up to 2.14, its CI builds 2.17: "
                            f">={low},<{high}){usable}"))
    return checks


def check_gpu(machine: Machine) -> list[Check]:
    import torch

    if not machine.gpu:
        return [Check("GPU", "SKIP", "no CUDA device: CPU rehearsal on gloo"),
                Check("NCCL", "SKIP", "no CUDA device")]
    props = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability(0)
    gpu = Check("GPU", "PASS", f"{torch.cuda.device_count()}× {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                f"compute capability {major}.{minor}, CUDA {torch.version.cuda}, "
                f"FP8 tensor cores: {'yes' if machine.fp8 else 'no (needs 8.9+)'}")
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        nccl_check = Check("NCCL", "PASS", f"{nccl} (collectives run in every training check below)")
    except Exception as e:  # a torch build without NCCL
        nccl_check = Check("NCCL", "FAIL", f"torch.cuda.nccl.version() failed: {e}")
    return [gpu, nccl_check]


class Runs:
    """Starts the recipe on one process for each check and reads back its losses."""

    def __init__(self, workdir: Path, machine: Machine):
        self.workdir, self.machine = workdir, machine
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.base = [
            "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
            "parallel.sequence_parallel=false", "model.num_layers=2", "model.vocab_size=1024",
            "data.mock=true", "data.tokenizer_model=null",
            f"train.train_iters={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2",
            "train.eval_iters=0", "optimizer.lr_warmup_iters=1", "logging.log_interval=1", "checkpoint.save=null",
            f"train.precision={'bf16' if machine.gpu else 'fp32'}",
        ]

    def train(self, name: str, spec: str, *overrides: str, fp8: bool = False) -> dict[int, float]:
        """Run the recipe under `spec` (te | local); {step: loss}. Raises RuntimeError naming the log on failure."""
        tb = self.workdir / "tb" / name
        args = [*self.base, f"model.attention_backend={spec}", f"logging.tensorboard_dir={tb}",
                f"logging.log_dir={self.workdir / 'runs' / name}",  # rank logs and the run record: not the checkout
                *(["train.fp8=delayed"] if fp8 else []), *overrides]
        # one process needs no launcher: the recipe starts a world of one itself (~5 s less per check)
        self._run(name, ["-m", "recipes.pretrain", "--config", str(ROOT / "configs" / "tiny.yaml"), *args])
        from megatron_ext.metrics.run_logger import read_scalars

        return read_scalars(tb, "train/lm_loss")

    def convert(self, name: str, *args: str) -> None:
        self._run(name, ["-m", "recipes.convert", *args])

    def _run(self, name: str, args: list[str]) -> None:
        log = self.logs / f"{name}.log"
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with log.open("w") as out:
            proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            tail = [line for line in log.read_text().splitlines() if "error" in line.lower()][-1:]
            raise RuntimeError(f"exit {proc.returncode}; see {log}" + (f": {tail[0].strip()}" if tail else ""))


def _compare(name: str, got: dict[int, float], reference: dict[int, float], steps: range, bound: float,
             what: str) -> Check:
    if sorted(got) != list(steps):
        return Check(name, "FAIL", f"logged steps {sorted(got)}, expected {list(steps)}")
    diff = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in steps)
    losses = ", ".join(f"{s}: {got[s]:.4f}/{reference[s]:.4f}" for s in steps)
    return Check(name, "PASS" if diff <= bound else "FAIL",
                 f"{what}; max relative difference {diff:.1e} (bound {bound:.0e}); loss vs reference {losses}")


def run_training_checks(runs: Runs, machine: Machine) -> list[Check]:
    """5 steps, stop/resume, HF round trip and (with TE) the layer-spec interchange, each from the same weights."""
    spec = "te" if machine.te and machine.gpu else "local"
    fp8 = spec == "te" and machine.fp8
    same = SAME_SPEC["gpu" if machine.gpu else "cpu"]
    ckpt = runs.workdir / "checkpoints"
    init = [f"checkpoint.pretrained_checkpoint={ckpt / 'init'}"]
    checks: list[Check] = []

    def attempt(name: str, body: Callable[[], Check]) -> None:
        start = time.perf_counter()
        try:
            check = body()
        except Exception as e:  # a failed run: report it and go on with the other checks
            check = Check(name, "FAIL", str(e))
        check.detail += f" [{time.perf_counter() - start:.0f} s]"
        checks.append(check)
        print(f"{check.status:4}  {check.name}: {check.detail}", flush=True)

    reference: dict[str, dict[int, float]] = {}

    def first_run() -> Check:
        runs.train("init", spec, "train.train_iters=0", f"checkpoint.save={ckpt / 'init'}")
        losses = reference["full"] = runs.train("full", spec, *init, fp8=fp8)
        ok = sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
        layer = "TransformerEngine layer spec" + (" + FP8 (delayed scaling)" if fp8 else "") if spec == "te" \
            else "megatron-core local layer spec"
        return Check(f"train {STEPS} steps", "PASS" if ok else "FAIL",
                     f"{layer}, {'bf16 on GPU' if machine.gpu else 'fp32 on CPU'}; loss {losses[1]:.4f} -> "
                     f"{losses[max(losses)]:.4f}")

    attempt(f"train {STEPS} steps", first_run)
    if "full" not in reference:
        return checks  # every later check compares against this run
    full = reference["full"]

    def save_resume() -> Check:
        runs.train("first", spec, *init, f"train.exit_interval={STOP}", f"checkpoint.save={ckpt / spec}", fp8=fp8)
        resumed = runs.train("resumed", spec, f"checkpoint.load={ckpt / spec}", fp8=fp8)
        return _compare("save and resume", resumed, full, range(STOP + 1, STEPS + 1), same,
                        f"stopped at {STOP}, resumed under the same spec")

    attempt("save and resume", save_resume)

    def hf_round_trip() -> Check:
        hf, imported = runs.workdir / "hf", ckpt / "imported"
        runs.convert("export", "export-hf", "--checkpoint", str(ckpt / spec), "--output", str(hf))
        runs.convert("import", "import-hf", "--hf-dir", str(hf), "--output", str(imported))
        weights = runs.train("from_weights", spec, f"checkpoint.pretrained_checkpoint={ckpt / spec}", "train.train_iters=2")
        from_hf = runs.train("from_hf", spec, f"checkpoint.load={imported}", "train.train_iters=2")
        return _compare("Hugging Face import", from_hf, weights, range(1, 3), same,
                        f"step-{STOP} weights exported to HF, imported, trained under the {spec} spec vs the same "
                        "weights loaded directly")

    attempt("Hugging Face import", hf_round_trip)
    if spec != "te":
        reason = "needs TransformerEngine on a GPU" if machine.gpu or not machine.te else "needs a GPU"
        checks.append(Check("TE <-> local checkpoints", "SKIP", f"{reason}; CI proves it with TE-shaped stand-ins "
                            "(tests/integration/test_te_interchange.py)"))
        print(f"SKIP  {checks[-1].name}: {checks[-1].detail}", flush=True)
        return checks

    def interchange() -> Check:
        reference = full if not fp8 else runs.train("full_bf16", "te", *init)
        # bf16, in the format that loads into another layer spec's buffers (the default mid-run one does not)
        reshardable = [*init, f"train.exit_interval={STOP}", "checkpoint.optimizer_format=fully_reshardable"]
        runs.train("te_first", "te", *reshardable, f"checkpoint.save={ckpt / 'te_reshardable'}")
        results = [_compare("TE -> local", runs.train("te_to_local", "local", f"checkpoint.load={ckpt / 'te_reshardable'}"),
                            reference, range(STOP + 1, STEPS + 1), CROSS_SPEC, "TE checkpoint resumed by local layers")]
        runs.train("local_first", "local", *reshardable, f"checkpoint.save={ckpt / 'local'}")
        results.append(_compare("local -> TE", runs.train("local_to_te", "te", f"checkpoint.load={ckpt / 'local'}"),
                                reference, range(STOP + 1, STEPS + 1), CROSS_SPEC,
                                "local checkpoint (torch AdamW) resumed by TE layers + TE FusedAdam"))
        status = "PASS" if all(r.status == "PASS" for r in results) else "FAIL"
        return Check("TE <-> local checkpoints", status, " | ".join(f"{r.name}: {r.detail}" for r in results))

    attempt("TE <-> local checkpoints", interchange)
    return checks


def detect() -> Machine:
    from megatron_ext.model.llama import gpu_compute_capability, transformer_engine_available

    capability = gpu_compute_capability()
    return Machine(gpu=capability is not None, te=transformer_engine_available(), compute_capability=capability)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="keep checkpoints and logs here (default: a temporary dir)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON")
    args = parser.parse_args(argv)
    print(f"recipes.doctor on {os.uname().nodename}, Python {sys.version.split()[0]}", flush=True)
    try:
        machine = detect()
    except ImportError as e:  # megatron-core itself does not import (a broken TransformerEngine, say)
        print(f"FAIL  megatron-core: cannot be imported: {e}", flush=True)
        return 1
    checks = [*check_versions(machine), *check_gpu(machine)]
    for check in checks:
        print(f"{check.status:4}  {check.name}: {check.detail}", flush=True)
    with tempfile.TemporaryDirectory(prefix="doctor-") as tmp:
        workdir = args.workdir or Path(tmp)
        checks += run_training_checks(Runs(workdir, machine), machine)
    counts = {s: sum(c.status == s for c in checks) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
          + (f"; logs of failed runs: {args.workdir / 'logs'}" if counts["FAIL"] and args.workdir else
             "; rerun with --workdir DIR to keep the logs" if counts["FAIL"] else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": asdict(machine), "checks": [asdict(c) for c in checks]}, indent=2))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":  # guard required: the runs it starts spawn checkpoint helpers
    sys.exit(main())
