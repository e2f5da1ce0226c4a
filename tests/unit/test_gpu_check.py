"""The GPU checklist's plan (every GPU-only test file and the measurements docs/performance.md asks for) and its
one-line refusal on a machine without a GPU."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_ext.resilience.run_record import TrainingRecord, write_training_end
from recipes import gpu_check
from tests.launch import ROOT


def test_the_checklist_runs_every_gpu_only_test_and_the_benchmark_with_the_timers_cost(tmp_path, capsys):
    assert gpu_check.main(["--list", "--out", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    # every test file that skips itself for want of a GPU ("need(s) a GPU" in its reason)
    skipped_on_cpu = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                      if re.search(r"reason=.*needs? a GPU", path.read_text())}
    assert skipped_on_cpu >= {"tests/integration/test_cuda_graphs.py", "tests/integration/test_liger.py"}
    assert all(path in listed for path in skipped_on_cpu), (skipped_on_cpu, listed)
    names = [s.name for s in gpu_check.steps(tmp_path)]
    assert names == ["gpu-tests", "doctor", "benchmark", "benchmark-moe", "fused-linear-ce", "profile"]
    assert "megatron-untimed" in gpu_check.steps(tmp_path)[2].what
    assert "moe" in gpu_check.steps(tmp_path)[3].command
    assert "logging.memory_snapshot=true" in gpu_check.steps(tmp_path)[5].command


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu-check: no GPU here")
    assert not any(tmp_path.iterdir())


def test_a_step_passes_only_with_its_evidence_not_by_skipping(tmp_path):
    """Exit 0 is not enough: pytest exits 0 when every test skips (no TE, no liger on this GPU), the doctor when a
    check skips, a benchmark or profile run that wrote nothing; each is INCOMPLETE, naming what is missing."""
    step = {s.name: s for s in gpu_check.steps(tmp_path)}
    status = gpu_check.step_status
    skipped = ("SKIPPED [1] tests/integration/test_liger.py:28: liger-kernel's kernels are Triton\n"
               "3 passed, 1 skipped in 12.0s\n")
    assert status(step["gpu-tests"], 0, skipped, tmp_path).startswith("INCOMPLETE (1 skipped: tests/integration/")
    assert status(step["gpu-tests"], 0, "7 passed in 40.1s\n", tmp_path) == "PASS"
    assert status(step["gpu-tests"], 1, "1 failed, 6 passed\n", tmp_path) == "FAIL (exit 1)"
    assert status(step["gpu-tests"], None, "", tmp_path) == "TIMEOUT"
    doctor = "PASS  GPU: 1× H100\nSKIP  TransformerEngine: not installed: local layers\n"
    assert status(step["doctor"], 0, doctor, tmp_path) == "INCOMPLETE (1 skipped: TransformerEngine)"
    assert status(step["benchmark"], 0, "", tmp_path).startswith("INCOMPLETE (no benchmark/benchmark.json under")
    (tmp_path / "benchmark").mkdir()
    (tmp_path / "benchmark" / "benchmark.json").write_text("{}")
    assert status(step["benchmark"], 0, "", tmp_path) == "PASS"
    assert status(step["fused-linear-ce"], 0, "", tmp_path).startswith("INCOMPLETE (the run did not record")
    write_training_end(tmp_path / "fused-linear-ce" / "logs", TrainingRecord("exit signal", 12))
    assert status(step["fused-linear-ce"], 0, "", tmp_path).startswith("INCOMPLETE (the run did not record")
    write_training_end(tmp_path / "fused-linear-ce" / "logs", TrainingRecord("finished", 20))
    assert status(step["fused-linear-ce"], 0, "", tmp_path) == "PASS"
    assert status(step["profile"], 0, "", tmp_path).startswith("INCOMPLETE (no profile/profile/rank-0.iter_4-5.json")
