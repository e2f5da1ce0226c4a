"""train.rerun_mode on CPU/gloo, a tiny MoE at PP2 with two virtual stages per rank (the schedule reads one data
iterator per model chunk, each replayed), the auxiliary-loss-free expert bias (which the end of every step updates,
so a re-run must start from the bias before it) and dropout (which must draw the same masks again): the last stage's
NaN that a re-run of the step does not meet again is healed and leaves every step's loss and gradient norm
bit-identical to a run that never met it; a NaN that recurs is skipped as train.skip_nonfinite_steps says, as without
re-runs; report_determinism_stats runs each step twice and finds the CPU bit-reproducible but for the step whose
first run met the fault (tests/workers/faulty_step_worker.py makes the faults). Without the bias restored, or megatron-core's random states,
the healed run's numbers differ from the reference (tried). Under train.recurring_fault=rerun_elsewhere a fault that
recurs in place stops the job (exit 16) with the state before the step saved, and the step runs again on another
"node" (SLURMD_NODENAME), which tells a faulty GPU from the data."""

from __future__ import annotations

import json
import math
import re

import pytest

from megatron_ext.checkpoint.layout import RERUN_ELSEWHERE, complete_iterations
from megatron_ext.errors import EXIT_RERUN_ELSEWHERE
from megatron_ext.resilience.run_record import verdict
from tests.launch import ROOT, SMALL_MODEL, read_scalars, run_pretrain

TRANSIENT, RECURRING, STEPS = 2, 4, 5  # the first step after a start is not checked (megatron-core's rule)
TRANSIENT_SPIKE, RECURRING_SPIKE = 3, 5
FAULTY_RANK = 1  # the last pipeline stage, where the loss is computed


def _run(root, mode: str, faults: dict[str, str], steps: int = STEPS, name: str = "", extra: tuple[str, ...] = (),
         exit_code: int = 0) -> tuple[str, dict[str, dict[int, float]]]:
    """A run's console and its every-step numbers."""
    name = name or mode
    tb = root / f"tb_{name}"
    proc = run_pretrain(2, [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1",
                            "parallel.pipeline_model_parallel_size=2", "parallel.sequence_parallel=false",
                            "parallel.virtual_pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=1", f"train.train_iters={steps}",
                            "checkpoint.save=null", f"logging.tensorboard_dir={tb}",
                            f"logging.log_dir={root / f'logs_{name}'}", "model.moe_router_score_function=sigmoid",
                            "model.moe_router_enable_expert_bias=true", "model.moe_aux_loss_coeff=0",
                            "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
                            "train.skip_nonfinite_steps=1", "train.spike_policy=skip", "train.spike_window=5",
                            f"train.rerun_mode={mode}", *extra],
                        config=ROOT / "configs" / "tiny_moe.yaml", module="tests.workers.faulty_step_worker",
                        env={"FAULTY_RANK": str(FAULTY_RANK), **faults}, check=exit_code == 0)
    # the suite's launcher ends as torchrun does (1) and names the rank's code
    assert exit_code == 0 or f"failed first, exitcode : {exit_code}" in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    tags = ("train/lm_loss", "train/grad_norm", "train/transient_faults", "train/rerun_relative_difference")
    return proc.stdout + proc.stderr, {tag: read_scalars(tb, tag) for tag in tags}


@pytest.fixture(scope="module")
def without_reruns(tmp_path_factory):
    """The recurring faults only, train.rerun_mode=disabled: what a healed run must end as."""
    return _run(tmp_path_factory.mktemp("reruns"), "disabled",
                {"RECURRING_AT": str(RECURRING), "RECURRING_SPIKE_AT": str(RECURRING_SPIKE)})


def test_a_transient_fault_is_healed_and_a_recurring_one_is_skipped_as_without_reruns(without_reruns, tmp_path):
    """A NaN at 2 and a loss spike at 3 on the first run only are healed; the NaN at 4 and the spike at 5 recur and
    are skipped (train.skip_nonfinite_steps, train.spike_policy=skip)."""
    said, numbers = _run(tmp_path, "validate_results",
                         {"TRANSIENT_AT": str(TRANSIENT), "RECURRING_AT": str(RECURRING),
                          "TRANSIENT_SPIKE_AT": str(TRANSIENT_SPIKE), "RECURRING_SPIKE_AT": str(RECURRING_SPIKE)})
    healed = [line for line in said.splitlines() if "non-finite loss did not recur" in line]
    assert len(healed) == 1 and (f"[rank {FAULTY_RANK}] iteration {TRANSIENT}: this rank's non-finite loss did not "
                                 "recur") in healed[0], said[-4000:]
    assert "(node " in healed[0] and "the step goes on with the re-run's result" in healed[0]
    recurred = [line for line in said.splitlines() if "non-finite loss recurred when the step was re-run" in line]
    assert len(recurred) == 1 and f"[rank {FAULTY_RANK}] iteration {RECURRING}: " in recurred[0], recurred
    assert f"skipped: non-finite loss at iteration {RECURRING}" in said
    assert (f"iteration {TRANSIENT_SPIKE}: the loss spike of the step's first run" in said
            and "did not recur when it was re-run on the same GPUs" in said), said[-4000:]
    assert f"iteration {RECURRING_SPIKE}: the loss spike recurred when the step was re-run on the same GPUs" in said
    assert f"loss spike at iteration {RECURRING_SPIKE}: " in said and "skipped (1 of train.max_rewinds=3)" in said
    assert "2 step(s) with a transient fault healed" in said
    assert numbers["train/transient_faults"] == {TRANSIENT: 1.0, TRANSIENT_SPIKE: 2.0}
    discarded = re.search(r"goodput [\d.]+ % of .*: recomputed steps ([\d.]+) %", said)  # the steps' first runs
    assert discarded and float(discarded.group(1)) > 0.5, said[-1500:]

    said_without, without = without_reruns
    assert f"skipped: non-finite loss at iteration {RECURRING}" in said_without and "recomputed" not in said_without
    assert sorted(without["train/lm_loss"]) == [s for s in range(1, STEPS + 1) if s not in (RECURRING, RECURRING_SPIKE)]
    for tag in ("train/lm_loss", "train/grad_norm"):  # bit for bit
        assert numbers[tag] == without[tag], tag


def test_determinism_stats_run_every_step_twice_and_find_the_cpu_bit_reproducible_but_for_a_fault(without_reruns,
                                                                                                  tmp_path):
    """Each step's run and re-run agree bit for bit on CPU, except step 2's, whose first run met the NaN: its
    difference is infinite, and the step goes on with the re-run's result."""
    said, numbers = _run(tmp_path, "report_determinism_stats", {"TRANSIENT_AT": str(TRANSIENT)}, steps=RECURRING - 1)
    assert numbers["train/rerun_relative_difference"] == {
        s: math.inf if s == TRANSIENT else 0.0 for s in range(1, RECURRING)}, said[-3000:]
    assert "every step was run twice; the two results' loss and gradient sums differed by at most inf " in said
    _, without = without_reruns
    assert numbers["train/lm_loss"] == {s: without["train/lm_loss"][s] for s in range(1, RECURRING)}


def test_a_fault_that_recurs_in_place_runs_again_on_another_node_which_tells_a_faulty_gpu_from_the_data(
        without_reruns, tmp_path):
    """Step 2's transient NaN heals in place. Step 3 fails on every run on node-a only: the job saves iteration 2 and
    exits 16, naming node-a in the run record; on node-a again it refuses to start; on node-b step 3 is clean
    (node-a's GPU was faulty) and the run goes on. Then step 4, made to fail everywhere with its re-run elsewhere
    pending, recurs on node-b: the data's, skipped. Every step's numbers equal the run that skipped step 4 without
    re-runs."""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    common = (f"checkpoint.save={ckpt}", "train.recurring_fault=rerun_elsewhere", f"logging.log_dir={logs}")
    on = {"node-a": {"SLURMD_NODENAME": "node-a"}, "node-b": {"SLURMD_NODENAME": "node-b"}}
    faulty_gpu = {"RECURRING_AT": "3", "FAULTY_NODE": "node-a"}

    said, first = _run(tmp_path, "validate_results", {**faulty_gpu, "TRANSIENT_AT": str(TRANSIENT), **on["node-a"]},
                       name="first", extra=common, exit_code=EXIT_RERUN_ELSEWHERE)
    assert f"iteration {TRANSIENT}: this rank's non-finite loss did not recur" in said  # healed in place, no stop
    assert "iteration 3's non-finite result recurred when re-run on the same GPUs (rank 1's loss on node node-a" in said
    assert "resume without node(s) node-a" in said, said[-3000:]
    assert complete_iterations(ckpt) == [2] and sorted(first["train/lm_loss"]) == [1, 2]
    pending = json.loads((ckpt / RERUN_ELSEWHERE).read_text())
    assert pending["iteration"] == 3 and [s["node"] for s in pending["suspects"]] == ["node-a"], pending
    assert verdict(logs)["ENDED"] == "rerun elsewhere" and verdict(logs)["SUSPECT_NODES"] == "node-a"

    said, _ = _run(tmp_path, "validate_results", {**faulty_gpu, **on["node-a"]}, name="again", extra=common,
                   exit_code=EXIT_RERUN_ELSEWHERE)
    assert re.search(r"but rank \d is on node node-a, device \d+ again", said), said[-3000:]

    said, elsewhere = _run(tmp_path, "validate_results", {**faulty_gpu, **on["node-b"]}, name="elsewhere",
                           extra=(*common, "train.exit_interval=3"))
    assert "iteration 3: the fault that recurred on rank 1's loss on node node-a" in said
    assert "did not recur on other GPUs: that GPU is faulty" in said and not (ckpt / RERUN_ELSEWHERE).exists()

    # a pending re-run whose fault recurs elsewhere is the data's (written as the job above would have)
    (ckpt / RERUN_ELSEWHERE).write_text(json.dumps({"iteration": RECURRING, "suspects": [
        {"rank": FAULTY_RANK, "node": "node-a", "device": 0, "what": "loss"}]}))
    said, last = _run(tmp_path, "validate_results", {"RECURRING_AT": str(RECURRING), **on["node-b"]}, name="last",
                      extra=common)
    assert f"iteration {RECURRING}: the non-finite result that recurred on rank 1's loss on node node-a" in said
    assert "recurred on other GPUs too: the data or the model made it" in said
    assert f"skipped: non-finite loss at iteration {RECURRING}" in said

    _, without = without_reruns  # its step 5 met a spike; after the resume at 3 the spike window is empty
    assert sorted(last["train/lm_loss"]) == [STEPS]
    for tag in ("train/lm_loss", "train/grad_norm"):
        assert {**first[tag], **elsewhere[tag]} == without[tag], tag
