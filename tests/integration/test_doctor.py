"""`python -m recipes.doctor` on this CPU machine: the CPU subset passes, the GPU/TE checks skip with a reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import ROOT


def test_doctor_passes_on_cpu_and_says_what_it_skipped(tmp_path):
    report = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "recipes.doctor", "--workdir", str(tmp_path / "work"),
                           "--json", str(report)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = {c["name"]: (c["status"], c["detail"]) for c in json.loads(report.read_text())["checks"]}
    for name in ("megatron-core", "torch", "train 5 steps", "save and resume", "Hugging Face import"):
        assert status[name][0] == "PASS", (name, status[name])
    for name in ("TransformerEngine", "GPU", "NCCL", "TE <-> local checkpoints"):
        assert status[name][0] == "SKIP" and status[name][1], (name, status[name])
    # the resume and the HF round trip are exact on CPU (fp32, deterministic)
    assert "max relative difference 0.0e+00" in status["save and resume"][1]
    assert "max relative difference 0.0e+00" in status["Hugging Face import"][1]
    assert "5 passed, 0 failed, 4 skipped" in proc.stdout


