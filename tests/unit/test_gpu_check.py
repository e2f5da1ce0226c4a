"""The GPU checklist's plan (every GPU-only test file and the measurements docs/performance.md asks for) and its
one-line refusal on a machine without a GPU."""

from __future__ import annotations

import re

import pytest
import torch

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
