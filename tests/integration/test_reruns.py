"""train.rerun_mode on CPU/gloo, a tiny MoE at PP2 with two virtual stages per rank (the schedule reads one data
iterator per model chunk, each replayed), the auxiliary-loss-free expert bias (which the end of every step updates,
so a re-run must start from the bias before it) and dropout (which must draw the same masks again): the last stage's
NaN that a re-run of the step does not meet again is healed and leaves every step's loss and gradient norm
bit-identical to a run that never met it; a NaN that recurs is skipped as train.skip_nonfinite_steps says, as without
re-runs; report_determinism_stats runs each step twice and finds the CPU bit-reproducible but for the step whose
first run met the fault (tests/workers/faulty_step_worker.py makes the faults). Without the bias restored, or megatron-core's random states,
the healed run's numbers differ from the reference (tried)."""

from __future__ import annotations

import math
import re

import pytest

from tests.launch import ROOT, SMALL_MODEL, read_scalars, run_pretrain

TRANSIENT, RECURRING, STEPS = 2, 4, 5  # the first step after a start is not checked (megatron-core's rule)
FAULTY_RANK = 1  # the last pipeline stage, where the loss is computed


def _run(root, mode: str, faults: dict[str, str], steps: int = STEPS) -> tuple[str, dict[str, dict[int, float]]]:
    """A run's console and its every-step numbers."""
    tb = root / f"tb_{mode}"
    proc = run_pretrain(2, [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1",
                            "parallel.pipeline_model_parallel_size=2", "parallel.sequence_parallel=false",
                            "parallel.virtual_pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=1", f"train.train_iters={steps}",
                            "checkpoint.save=null", f"logging.tensorboard_dir={tb}",
                            f"logging.log_dir={root / f'logs_{mode}'}", "model.moe_router_score_function=sigmoid",
                            "model.moe_router_enable_expert_bias=true", "model.moe_aux_loss_coeff=0",
                            "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
                            "train.skip_nonfinite_steps=1", f"train.rerun_mode={mode}"],
                        config=ROOT / "configs" / "tiny_moe.yaml", module="tests.workers.faulty_step_worker",
                        env={"FAULTY_RANK": str(FAULTY_RANK), **faults})
    tags = ("train/lm_loss", "train/grad_norm", "train/transient_faults", "train/rerun_relative_difference")
    return proc.stdout, {tag: read_scalars(tb, tag) for tag in tags}


@pytest.fixture(scope="module")
def without_reruns(tmp_path_factory):
    """The recurring fault only, train.rerun_mode=disabled: what a healed run must end as."""
    return _run(tmp_path_factory.mktemp("reruns"), "disabled", {"RECURRING_AT": str(RECURRING)})


def test_a_transient_fault_is_healed_and_a_recurring_one_is_skipped_as_without_reruns(without_reruns, tmp_path):
    said, numbers = _run(tmp_path, "validate_results",
                         {"TRANSIENT_AT": str(TRANSIENT), "RECURRING_AT": str(RECURRING)})
    healed = [line for line in said.splitlines() if "did not recur" in line]
    assert len(healed) == 1 and (f"[rank {FAULTY_RANK}] iteration {TRANSIENT}: this rank's non-finite loss did not "
                                 "recur") in healed[0], said[-4000:]
    assert "(node " in healed[0] and "the step goes on with the re-run's result" in healed[0]
    recurred = [line for line in said.splitlines() if "recurred when the step was re-run" in line]
    assert len(recurred) == 1 and f"[rank {FAULTY_RANK}] iteration {RECURRING}: " in recurred[0], recurred
    assert f"skipped: non-finite loss at iteration {RECURRING}" in said
    assert "1 step(s) with a transient fault healed" in said
    assert numbers["train/transient_faults"] == {TRANSIENT: 1.0}
    discarded = re.search(r"goodput [\d.]+ % of .*: recomputed steps ([\d.]+) %", said)  # the steps' first runs
    assert discarded and float(discarded.group(1)) > 0.5, said[-1500:]

    said_without, without = without_reruns
    assert f"skipped: non-finite loss at iteration {RECURRING}" in said_without and "recomputed" not in said_without
    assert sorted(without["train/lm_loss"]) == [s for s in range(1, STEPS + 1) if s != RECURRING]
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
