"""The throughput benchmark runs end to end on CPU with the tiny preset (no speed assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import ROOT

pytestmark = pytest.mark.slow


def test_benchmark_writes_table_json_and_chart(tmp_path):
    # The compile variants are left out: compiling on 2 CPU cores costs more than the rest together
    # (train.compile's numerics are in the parity matrix).
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.benchmark", "--preset", "tiny", "--warmup", "1", "--steps", "2",
         "--variants", "megatron", "megatron-fused", "hf", "--out-dir", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vs best peer (hf)" in proc.stdout
    record = json.loads((tmp_path / "benchmark.json").read_text())
    assert [r["variant"] for r in record["results"]] == ["megatron", "megatron-fused", "hf"]
    assert all(r["tokens_per_sec"] > 0 and r["tflops_per_device"] > 0 for r in record["results"])
    assert (tmp_path / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
