"""The throughput benchmark: an end-to-end CPU run (tiny preset, no speed assertions) and valid GPU configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_ext.config.validate import validate_layout
from recipes import benchmark
from tests.launch import ROOT


@pytest.mark.slow
def test_benchmark_writes_table_json_chart_and_per_micro_batch_comparisons(tmp_path):
    # The compile variants are left out: compiling on 2 CPU cores costs more than the rest together
    # (train.compile's numerics are in the parity matrix); the pure-bf16 peer too (the regime split is unit-tested
    # below). bf16, so that the autocast peer runs.
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.benchmark", "--preset", "tiny", "--precision", "bf16", "--warmup", "1",
         "--steps", "2", "--micro-batch-sizes", "1", "2", "--seq-length", "64",
         "--variants", "megatron-eager", "megatron-fp8", "hf-amp", "--out-dir", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping megatron-fp8: needs TransformerEngine" in proc.stdout
    record = json.loads((tmp_path / "benchmark.json").read_text())
    runs = [(r["variant"], r["micro_batch_size"], r["seq_length"], r["master_weights"]) for r in record["results"]]
    assert runs == [("megatron-eager", 1, 64, "fp32"), ("megatron-eager", 2, 64, "fp32"), ("hf-amp", 1, 64, "fp32"),
                    ("hf-amp", 2, 64, "fp32")]
    assert all(r["tokens_per_sec"] > 0 and r["tflops_per_device"] > 0 for r in record["results"])
    assert [(c["micro_batch_size"], c["same_regime"]["peer"]) for c in record["comparisons"]] == [(1, "hf-amp"),
                                                                                                  (2, "hf-amp")]
    for c in record["comparisons"]:
        assert f"micro batch {c['micro_batch_size']}: megatron-eager vs the fastest peer of its master-weight " \
               f"regime (hf-amp) {c['same_regime']['ratio']:.2f}×" in proc.stdout
    assert (tmp_path / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peers_are_compared_within_their_master_weight_regime():
    def result(variant: str, mbs: int, tokens_per_sec: float) -> benchmark.Result:
        master, regime = benchmark.regime(variant, "bf16")
        return benchmark.Result(variant, mbs, 4096, master, regime, "gpu", tokens_per_sec, 1.0, None, None, None,
                                1.0, 1)

    rows = benchmark.comparisons([result("megatron-eager", 1, 40), result("megatron-compile", 1, 45),
                                  result("hf", 1, 46), result("hf-amp-compile", 1, 42), result("hf-amp", 1, 34)])
    assert rows == [{"micro_batch_size": 1, "recipe": "megatron-compile",
                     "same_regime": {"peer": "hf-amp-compile", "ratio": 45 / 42},
                     "overall": {"peer": "hf", "ratio": 45 / 46}}]


@pytest.mark.parametrize("te_available", [False, True])
@pytest.mark.parametrize("variant", list(benchmark.MEGATRON_VARIANTS))
def test_every_recipe_variant_is_a_valid_gpu_config(variant, te_available):
    """GPU runs are rare: a variant the config rules reject must fail here, not on the GPU."""
    shape = {**benchmark.PRESETS["1b"], "micro_batch_size": 4}
    reason = benchmark.unavailable(variant, shape, "bf16", te_available, fp8_capable=True, on_gpu=True)
    if reason:  # skipped by the benchmark with the recipe's own reason
        expected = {"megatron-fp8": "TransformerEngine is not importable", "megatron-liger": "needs liger-kernel"}
        assert expected.get(variant) and expected[variant] in reason, (variant, reason)
        if variant == "megatron-fp8":
            assert not te_available
        return
    cfg = benchmark.recipe_config(shape, "bf16", steps=13, variant=variant)
    validate_layout(cfg, world_size=1, te_available=te_available, fp8_capable=True)
