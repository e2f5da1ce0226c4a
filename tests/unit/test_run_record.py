"""The end of a run as data (megatron_ext/resilience/run_record.py): what the SLURM templates read instead of console
text — written whole, read back, said as shell assignments by a module that needs only the standard library."""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_ext.resilience.run_record import (
    NodeRecord,
    TrainingRecord,
    forget,
    node_record_path,
    record_dir,
    verdict,
    write_node_end,
    write_training_end,
)
from tests.launch import ROOT


def test_the_verdict_names_how_training_ended_and_the_nodes_whose_rank_failed_by_itself(tmp_path):
    assert verdict(tmp_path) == {"ENDED": "", "ITERATION": "", "FAILED_NODES": "", "SUSPECT_NODES": ""}
    write_training_end(tmp_path, TrainingRecord("exit signal", 7))
    write_node_end(tmp_path, NodeRecord("node1", "failed", 139, failed_rank=0))
    write_node_end(tmp_path, NodeRecord("node2", "followed", 1))
    write_node_end(tmp_path, NodeRecord("node3", "failed", 1, failed_rank=5))
    write_node_end(tmp_path, NodeRecord("node5", "left", 16))  # its GPU repeated a fault: left out of a requeue too
    assert verdict(tmp_path) == {"ENDED": "exit signal", "ITERATION": "7", "FAILED_NODES": "node1,node3,node5",
                                 "SUSPECT_NODES": ""}
    forget(node_record_path(tmp_path, "node3"))
    forget(node_record_path(tmp_path, "node5"))
    (record_dir(tmp_path) / "node-node4.json").write_text('{"node": "node4", "outc')  # torn: not a verdict
    assert verdict(tmp_path)["FAILED_NODES"] == "node1"
    assert sorted(p.name for p in record_dir(tmp_path).iterdir()) == [
        "node-node1.json", "node-node2.json", "node-node4.json", "training.json"]  # no temporary files left


def test_the_shell_reads_the_verdict_with_a_python_that_has_no_torch(tmp_path):
    """The batch script evals the module's line; with the ranks in a container it runs the host's bare python3."""
    write_training_end(tmp_path, TrainingRecord("finished", 12))
    write_node_end(tmp_path, NodeRecord("gpu-a 1", "failed", 1, failed_rank=3))  # a name the shell must not split
    no_torch = ("import sys; sys.modules.update(torch=None, megatron=None, omegaconf=None, yaml=None); "
                "import runpy; runpy.run_module('megatron_ext.resilience.run_record', run_name='__main__')")
    script = f'eval "$({sys.executable} -c "{no_torch}" {tmp_path})"; echo "$ENDED|$ITERATION|$FAILED_NODES"'
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout == "finished|12|gpu-a 1\n", out.stderr


def test_a_record_that_cannot_be_written_is_a_warning(tmp_path, capsys):
    (tmp_path / "run-result").write_text("a file where the directory should be")
    write_training_end(tmp_path, TrainingRecord("finished", 3))
    assert "warning: could not write the run record" in capsys.readouterr().err
