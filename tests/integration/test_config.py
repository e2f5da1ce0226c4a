"""A bad layout from the command line: one line from recipes.launch before any rank starts, and once (not once
per rank) under plain torchrun."""

from __future__ import annotations

import subprocess
import sys

from tests.launch import ROOT, TINY


def test_bad_layout_is_one_line_from_the_launcher_and_once_under_plain_torchrun(tmp_path):
    """3 processes for a TP2×PP2 recipe: recipes.launch says it in one line and starts no rank; under plain
    torchrun every rank finds it before any process group exists and only rank 0 says it."""
    expected = ("config error: world size (processes started)=3 is invalid: must be a multiple of "
                "parallel.tensor_model_parallel_size × pipeline_model_parallel_size × context_parallel_size "
                "= 2×2×1 = 4")
    launch = subprocess.run([sys.executable, "-m", "recipes.launch", "--standalone", "--nproc-per-node", "3",
                             "--config", str(TINY)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert launch.returncode == 2 and launch.stderr.startswith(expected), launch.stderr
    assert len(launch.stderr.strip().splitlines()) == 1 and "[rank" not in launch.stdout, launch.stdout + launch.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         f"--log-dir={tmp_path}", "-m", "recipes.pretrain", "--config", str(TINY)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert expected in proc.stderr and proc.stderr.count("config error:") == 1, proc.stderr
    assert "megatron/core" not in proc.stderr and "[rank0]: Traceback" not in proc.stderr
    # a kernel this machine cannot run is refused by the launcher too, before any rank builds its model
    graphs = subprocess.run([sys.executable, "-m", "recipes.launch", "--standalone", "--nproc-per-node", "4",
                             "--config", str(TINY), "train.cuda_graph_impl=local"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert graphs.returncode == 2 and graphs.stderr.startswith(
        "config error: train.cuda_graph_impl='local' is invalid: CUDA graphs need a GPU"), graphs.stderr
    assert len(graphs.stderr.strip().splitlines()) == 1 and "[rank" not in graphs.stdout, graphs.stdout


