"""train.fused_linear_cross_entropy: the fused-output model trains exactly like megatron-core's GPTModel and HybridModel
(CPU, with a torch stand-in for liger-kernel's Triton kernel; the kernel itself is compared on a GPU in
test_liger.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import ROOT

# fp32, same weights, one forward/backward: measured loss 1.0e-7 and gradients 3.8e-7 relative. A wrong token
# order, a dropped loss mask or the wrong output weight moves the loss or a gradient by more than 1e-2.
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-6, 1e-5


def test_fused_output_reproduces_the_models_loss_and_gradients_tied_and_untied():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.workers.fused_output_worker"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["model_class"], r["untied"]) for r in reports] == [
        ("gpt", False), ("gpt", True), ("hybrid", False), ("hybrid", True)], proc.stdout
    for report in reports:
        print(report)
        assert report["loss_rel_diff"] <= LOSS_TOLERANCE, report
        assert report["max_grad_rel_diff"] <= GRAD_TOLERANCE, report
        assert report["output_weight_grad_norm"] > 0, report
        # the start-up log reads the fused output from the built model, and the native fused CE is not claimed
        assert "fused linear cross-entropy (reference_linear_cross_entropy)" in report["describe"], report
        assert "fused cross-entropy (native)" not in report["describe"], report
