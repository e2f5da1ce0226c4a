"""Ring attention (context parallel, no TE) equals full causal attention: outputs and input/weight grads, values of
the keys' head size or (multi-latent attention) another."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import ROOT, launch_prefix

TOLERANCE = 1e-5  # fp32: max |ring - full| / max |full|, per tensor; measured ≤ 2e-6


# CP4 only: CP2's ring runs in the parity matrix (tp2_cp2, dp2_cp2_hsdp2_zero3, dp2_tp2_pp2_cp2) and the
# document-masking test
@pytest.mark.parametrize("cp", [4])
def test_ring_attention_matches_full_attention(cp, tmp_path):
    out = tmp_path / "diffs.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, *launch_prefix(cp), "-m", "tests.workers.cp_attention_worker", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 12  # 3 sequence lengths × (MHA, GQA 2:1, GQA 4:1 / MQA, MLA's value head size)
    worst = {name: max(d.values()) for name, d in results.items()}
    assert all(v <= TOLERANCE for v in worst.values()), worst
