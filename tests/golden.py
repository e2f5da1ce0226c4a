"""Golden loss curve: the first 20 losses of the default recipe (configs/tiny.yaml, TP2×PP2, 4 processes).

A change that alters the numerics of the default run (model, data order, schedule, optimizer,
parallel plumbing) shows up here. When such a change is intended, regenerate and commit:

    .venv/bin/python -m tests.golden
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.launch import read_scalars, run_pretrain

GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_tp2_pp2_losses.json"
STEPS = 20
OVERRIDES = [f"train.train_iters={STEPS}", "checkpoint.save=null", "logging.log_interval=1"]


def produce(workdir: Path, stop_after: int = STEPS) -> dict[int, float]:
    """Run the default recipe on its STEPS-step schedule, stopped after `stop_after` steps; its per-step loss."""
    tensorboard_dir = workdir / "tb"
    run_pretrain(4, [*OVERRIDES, f"logging.tensorboard_dir={tensorboard_dir}",
                     *([f"train.exit_interval={stop_after}"] if stop_after < STEPS else [])])
    return read_scalars(tensorboard_dir, "train/lm_loss")


def load() -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads(GOLDEN.read_text())["losses"].items()}


def main() -> int:
    with tempfile.TemporaryDirectory() as workdir:
        losses = produce(Path(workdir))
    record = {
        "command": "torchrun --nproc-per-node 4 -m recipes.pretrain --config configs/tiny.yaml " + " ".join(OVERRIDES),
        "regenerate": "python -m tests.golden",
        "losses": {str(step): losses[step] for step in sorted(losses)},
    }
    GOLDEN.parent.mkdir(exist_ok=True)
    tmp = GOLDEN.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(GOLDEN)
    print(f"wrote {GOLDEN}: loss {losses[1]:.4f} -> {losses[STEPS]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
