"""Loss spikes on CPU/gloo, PP2: a run that rewinds past a corrupted batch ends bit-identical to a run whose data
skipped the same batches from the start, and a restart from the checkpoint before the spike skips them again."""

from __future__ import annotations

import json
import re
import shutil

from megatron_ext.checkpoint.layout import DATA_SKIPS, iteration_dir, write_tracker
from tests.conftest import parity_overrides
from tests.launch import read_scalars, run_pretrain

STEPS, SAVE_EVERY, SPIKE = 8, 4, 6  # checkpoints at 4 and 8; the batch of iteration 6 is corrupted
GLOBAL_BATCH = 8  # SMALL_MODEL's
TWO_STAGES = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
              "parallel.sequence_parallel=false"]
REWIND = ["train.spike_policy=rewind", "train.spike_window=5", f"checkpoint.save_interval={SAVE_EVERY}",
          "train.eval_interval=1000", "train.eval_iters=1"]
# the corrupted batch starts at this sample; the rewind goes back to iteration 4 and skips the batches of 5 and 6
SPIKED = {"SPIKE_AT_SAMPLE": str((SPIKE - 1) * GLOBAL_BATCH), "SPIKE_FACTOR": "30"}
SKIPPED = {"iteration": SAVE_EVERY, "from_sample": SAVE_EVERY * GLOBAL_BATCH, "to_sample": SPIKE * GLOBAL_BATCH}


def _run(initial_weights, root, ckpt: str, tb: str, module: str = "tests.workers.spiked_worker"):
    """A run saving into root/ckpt, logging to root/tb; its console output and TensorBoard directory."""
    proc = run_pretrain(2, [*parity_overrides(initial_weights, root / tb, STEPS), *TWO_STAGES, *REWIND,
                            f"checkpoint.save={root / ckpt}"], module=module, env=SPIKED)
    return proc.stdout, root / tb


def _numbers(tb) -> dict[str, dict[int, float]]:
    return {tag: read_scalars(tb, tag) for tag in ("train/lm_loss", "train/grad_norm", "val/lm_loss")}


def test_a_rewind_past_a_spike_ends_as_a_run_that_skipped_its_batches_and_a_restart_skips_them_again(
        initial_weights, tmp_path):
    said, rewound_tb = _run(initial_weights, tmp_path, "rewound", "tb_rewound")
    rewind = [line for line in said.splitlines() if "] loss spike at iteration" in line]
    assert len(rewind) == 1 and f"loss spike at iteration {SPIKE}: " in rewind[0], said[-4000:]
    assert f"samples {(SPIKE - 1) * GLOBAL_BATCH}..{SPIKE * GLOBAL_BATCH - 1} " in rewind[0]
    assert re.search(rf"rewound to iteration {SAVE_EVERY} \(\S+iter_{SAVE_EVERY:07d}\) \(1 of train.max_rewinds=3\)$",
                     rewind[0]), rewind[0]
    assert (f"data: after iteration {SAVE_EVERY} the training data goes on at sample {SPIKE * GLOBAL_BATCH}, "
            f"skipping samples {SAVE_EVERY * GLOBAL_BATCH}..{SPIKE * GLOBAL_BATCH - 1}") in said
    recorded = json.loads((tmp_path / "rewound" / DATA_SKIPS).read_text())
    assert [{k: v for k, v in entry.items() if k != "reason"} for entry in recorded] == [SKIPPED]
    assert read_scalars(rewound_tb, "train/rewinds") == {SPIKE: 1.0}

    # the same run whose data skips those batches from the start (its corrupted batch is never reached)
    (tmp_path / "skipped").mkdir()
    (tmp_path / "skipped" / DATA_SKIPS).write_text(json.dumps([SKIPPED]))
    said_skipped, skipped_tb = _run(initial_weights, tmp_path, "skipped", "tb_skipped")
    assert "loss spike" not in said_skipped
    rewound, skipped = _numbers(rewound_tb), _numbers(skipped_tb)
    assert sorted(skipped["train/lm_loss"]) == list(range(1, STEPS + 1)) and skipped["val/lm_loss"]
    assert rewound == skipped  # every step's loss and gradient norm, and the final validation loss, bit for bit

    # the rewound run dies before its next checkpoint: the restart from iteration 4 skips the batches again
    shutil.rmtree(iteration_dir(tmp_path / "rewound", STEPS))
    write_tracker(tmp_path / "rewound", SAVE_EVERY)
    said_restart, restart_tb = _run(initial_weights, tmp_path, "rewound", "tb_restart", module="recipes.pretrain")
    assert f"data: after iteration {SAVE_EVERY} the training data goes on at sample {SPIKE * GLOBAL_BATCH}" in said_restart
    restarted = _numbers(restart_tb)
    assert {tag: {i: v for i, v in values.items() if i > SAVE_EVERY} for tag, values in restarted.items()} == {
        tag: {i: v for i, v in values.items() if i > SAVE_EVERY} for tag, values in skipped.items()}
