"""Where the step's time goes, from real multi-process runs: the profiler's trace, the breakdown adding up to the step,
the pipeline bubble against (p−1)/(v·m) and the planner, and each advice rule provoked (and none for a healthy run)."""

from __future__ import annotations

import json
import re

import pytest

from tests.launch import SMALL_MODEL, read_scalars, run_pretrain

# step-time breakdowns and the advice drawn from them are wall-clock measurements (make test runs them alone)
pytestmark = pytest.mark.serial

DP2 = [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
       "parallel.sequence_parallel=false", "train.train_iters=8", "logging.log_interval=2"]
PP2 = [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
       "parallel.sequence_parallel=false", "train.train_iters=8", "logging.log_interval=2"]


def _advice(stdout: str) -> list[str]:
    return [line.split("advice: ", 1)[1] for line in stdout.splitlines() if "advice: " in line]


def test_the_profiler_writes_a_trace_of_the_chosen_iterations_on_the_chosen_rank(tmp_path):
    """2 processes (DP2), iterations 2-3 on rank 1 only: one Chrome trace with both steps' regions and the
    forward/backward work in them, its path in the log."""
    logs = tmp_path / "run" / "logs"
    proc = run_pretrain(2, [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1",
                            "parallel.pipeline_model_parallel_size=1", "parallel.sequence_parallel=false",
                            "train.train_iters=4", "logging.profile_steps=[2,3]", "logging.profile_ranks=[1]",
                            f"logging.log_dir={logs}"])
    traces = sorted((tmp_path / "run" / "profile").iterdir())
    assert [t.name for t in traces] == ["rank-1.iter_2-3.json"], traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names
    assert any(str(n).startswith("aten::mm") for n in names), sorted(map(str, names))[:50]
    assert f"rank 1: profiled iterations 2-3: {traces[0]} (open in https://ui.perfetto.dev" in proc.stdout


def test_the_step_time_breakdown_accounts_for_the_step_and_names_unbalanced_stages(tmp_path):
    """PP2 with the tiny model, 2 processes: each log interval's parts (megatron-core's compute, pipeline and
    grad-sync regions, and the loop's data, optimizer and loss sync; the mean over ranks) add up to the step time
    within 5 % over the intervals after the first. The last stage also runs the output layer and the loss (vocabulary
    4096, hidden 128: about two layers' worth), so the first waits for it: the advice says so, once, with the layer
    to move, and the run summary sets the breakdown beside the planner's."""
    proc = run_pretrain(2, [*PP2, f"logging.tensorboard_dir={tmp_path}"])
    step = read_scalars(tmp_path, "train/step_time_s")
    parts = {p: read_scalars(tmp_path, f"time/{p}_s") for p in
             ("compute", "pipeline", "grad_sync", "schedule", "optimizer", "loss_sync", "data", "other")}
    assert sorted(parts["compute"]) == [2, 4, 6, 8], parts
    logged = (4, 6, 8)  # after the first interval (the first step's allocations)
    steps = sum(step[i] for i in range(3, 9)) / 2  # per-step means summed over the three intervals
    named = sum(parts[p][i] for p in parts if p != "other" for i in logged)
    assert abs(steps - named) <= 0.05 * steps, (steps, {p: [v[i] for i in logged] for p, v in parts.items()})
    assert all(parts["pipeline"][i] > 0 and parts["compute"][i] > 0 for i in logged)
    assert re.search(r"step +4/8 \| .*\| compute \d+% pipeline \d+%", proc.stdout), proc.stdout
    advice = _advice(proc.stdout)
    assert len(advice) == 1 and "pipeline stages are unbalanced: stage 1 computes" in advice[0], proc.stdout
    assert "the last stage also runs the output layer and the loss" in advice[0]
    assert "step breakdown vs the planner, per step, mean over ranks (CPU rehearsal" in proc.stdout
    assert re.search(r"\n  +pipeline: \d+ ms \(\d+% of the step\), planned \d+ ms", proc.stdout), proc.stdout


def test_a_balanced_pipelines_bubble_is_the_planners_p_minus_1_over_v_m(tmp_path):
    """PP2 with stages of equal work (5 layers, 3 + 2 with the output layer and loss on the second; wider layers so
    they outweigh the loss) and m = 2 micro batches: the stages wait (p−1)/(v·m) = 1/2 of the compute, as planned
    (measured against planned within 0.55-1.6×: under the full suite's load on 2 cores it read 0.59 once; a planner
    off by 2× in either direction falls outside), and the advice is the bubble's, not the
    imbalance's."""
    proc = run_pretrain(2, [*PP2, "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_layers=5",
                            "parallel.num_layers_in_last_pipeline_stage=2", "train.global_batch_size=4"])
    row = re.search(r"\n  +pipeline: (\d+) ms \(\d+% of the step\), planned (\d+) ms \(\d+% of the step\): (\w+)",
                    proc.stdout)
    assert row and 0.55 <= int(row[1]) / int(row[2]) <= 1.6 and row[3] == "agrees", proc.stdout
    advice = _advice(proc.stdout)
    assert len(advice) == 1 and "the bubble is (PP−1)/(VPP·m) = 1/(1·2) = 0.50 of the compute" in advice[0], advice
    assert "unbalanced" not in advice[0]


def test_a_slow_loader_and_unhidden_gradient_sync_are_advised_and_a_healthy_run_is_not(tmp_path):
    """DP2 with one micro batch of 32 tokens per step for a wider model (the sync outweighs the compute: 18-27 % of
    the step on the least-waiting rank, where the small model's 128 tokens read 11-15 %), overlap off and a data
    loader that sleeps 20 ms per batch: the gradient sync and data-wait rules speak, each once, with the planner's
    gain. The small model with overlap on, 16 micro batches and no sleep gives no advice."""
    slow = run_pretrain(2, [*DP2, "parallel.overlap_grad_reduce=false", "train.global_batch_size=2",
                            "train.micro_batch_size=1", "model.seq_length=32", "model.hidden_size=256",
                            "model.ffn_hidden_size=1024"], module="tests.workers.slowed_worker",
                        env={"SLOW_DATA_MS": "20"})
    advice = _advice(slow.stdout)
    assert len(advice) == 2, slow.stdout
    assert advice[0].startswith("exposed gradient sync takes") and "parallel.overlap_grad_reduce=true" in advice[0]
    assert "the planner expects" in advice[0]
    assert advice[1].startswith("waiting for data takes") and "data.num_workers=2" in advice[1]
    # 16 micro batches per DP rank: the overlapped sync's exposed tail on the least-waiting rank reads 1-5 % per
    # interval on the 2-core VM (at 8 up to 10 %); the mean over ranks read 8-15 %, the ranks' skew included, and
    # the rule once spoke in CI
    healthy = run_pretrain(2, [*DP2, "parallel.overlap_grad_reduce=true", "train.global_batch_size=64"])
    assert _advice(healthy.stdout) == [], healthy.stdout
    assert "  grad sync: " in healthy.stdout and "  pipeline: " not in healthy.stdout  # no pipeline at PP 1
