"""docs/quickstart-gpu.md's CPU rehearsal, run as written: its bash block, extracted from the page, in an empty
directory (the repository's packages and configs reachable, nothing written into the checkout). Then what a user
would look for: the tokenizer and tokens where the recipe reads them, a resumed run, the test split, an ETA, text
from recipes.generate and a Hugging Face export."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from megatron_ext.checkpoint.layout import latest_iteration
from tests.launch import ROOT, read_scalars

DOC = ROOT / "docs" / "quickstart-gpu.md"


def rehearsal_block() -> str:
    text = DOC.read_text()
    block = text.split("<!-- rehearsal:begin -->\n```bash\n")[1].split("```\n<!-- rehearsal:end -->")[0]
    assert "python -m recipes.launch" in block
    return block


def test_the_gpu_quickstart_runs_as_written_at_cpu_size(tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    script = "set -euo pipefail\n" + rehearsal_block()
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    assert (tmp_path / "data/corpus/tokenizer/tokenizer.json").is_file()
    assert (tmp_path / "data/corpus/corpus_text_document.idx").is_file()
    assert "time to train train.train_iters=50,000" in out and "GB per save" in out
    run = tmp_path / "runs" / "llama3-8b"
    assert "world=4 = TP1 × CP4 × DP1 × PP1" in out, out[-6000:]
    assert re.search(r"step +2/12 \| .* left", out), out[-6000:]
    assert "resumed from runs/llama3-8b/checkpoints at iteration 12" in out
    assert latest_iteration(run / "checkpoints") == 16
    assert sorted(read_scalars(run / "tensorboard", "test/lm_loss")) == [12, 16]
    assert "--- 'def main('\ndef main(" in out, out[-3000:]  # what it writes is checked against transformers in
    # tests/integration/test_convert.py
    assert (run / "hf" / "config.json").is_file() and (run / "hf" / "tokenizer.json").is_file()
