"""The throughput benchmark end to end on CPU (the MoE preset at CPU size against transformers' Mixtral; no speed
assertions): table, JSON, chart and the per-micro-batch comparisons. The dense peer's construction is unit-tested
(tests/unit/test_benchmark.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.launch import ROOT, launch_prefix


def test_benchmark_writes_table_json_chart_and_per_micro_batch_comparisons(tmp_path):
    # The compile variants are left out: compiling on 2 CPU cores costs more than the rest together
    # (train.compile's numerics are in the parity matrix); the pure-bf16 peer too (the regime split is unit-tested
    # below). bf16, so that the autocast peer runs.
    proc = subprocess.run(
        [sys.executable, *launch_prefix(1), "-m", "recipes.benchmark", "--preset", "moe-tiny", "--precision", "bf16", "--warmup", "1",
         "--steps", "2", "--micro-batch-sizes", "2", "--seq-length", "64",
         "--variants", "megatron-eager", "megatron-untimed", "megatron-fp8", "hf-amp", "--out-dir", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping megatron-fp8: model.attention_backend='te' is invalid: TransformerEngine is not importable" \
        in proc.stdout  # the recipe's own rule, not a restatement
    record = json.loads((tmp_path / "benchmark.json").read_text())
    assert record["title"].startswith("moe-tiny: 2L h128 4 experts top-2 seq 64 bf16")
    runs = [(r["variant"], r["micro_batch_size"], r["seq_length"], r["master_weights"]) for r in record["results"]]
    assert runs == [("megatron-eager", 2, 64, "fp32"), ("megatron-untimed", 2, 64, "fp32"), ("hf-amp", 2, 64, "fp32")]
    assert all(r["tokens_per_sec"] > 0 and r["tflops_per_device"] > 0 for r in record["results"])
    assert [(c["micro_batch_size"], c["same_regime"]["peer"]) for c in record["comparisons"]] == [(2, "hf-amp")]
    for c in record["comparisons"]:
        assert f"micro batch {c['micro_batch_size']}: {c['recipe']} vs the fastest peer of its master-weight " \
               f"regime (hf-amp) {c['same_regime']['ratio']:.2f}×" in proc.stdout
    # the timers' cost: the recipe with and without the step breakdown (CPU noise makes its sign meaningless here)
    assert sorted(record["timer_overhead"]) == ["2"]
    assert re.search(r"micro batch 2: the step-breakdown timers cost [+-]\d+\.\d% step time", proc.stdout)
    assert (tmp_path / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


