"""The throughput benchmark: an end-to-end CPU run (tiny preset, no speed assertions) and valid GPU configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_ext.config import validate_layout
from recipes import benchmark
from tests.launch import ROOT


@pytest.mark.slow
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


@pytest.mark.parametrize("te_available", [False, True])
@pytest.mark.parametrize("variant", list(benchmark.MEGATRON_VARIANTS))
def test_every_recipe_variant_is_a_valid_gpu_config(variant, te_available):
    """GPU runs are rare: a variant the config rules reject must fail here, not on the GPU."""
    cfg = benchmark._recipe_config(benchmark.PRESETS["1b"], "bf16", steps=13, variant=variant)
    validate_layout(cfg, world_size=1, te_available=te_available, fp8_capable=True)
    assert cfg.train.fused_cross_entropy == (variant != "megatron")
