"""The default recipe's first 10 losses (of its 20-step schedule) equal the committed golden curve (regenerate:
python -m tests.golden, which records all 20)."""

from __future__ import annotations

from tests import golden

# Same machine kind, same torch and data: the run is deterministic and matches bit for bit;
# the bound only absorbs a different CPU instruction set choosing other kernels.
TOLERANCE = 1e-5
COMPARED_STEPS = 10  # half the curve: the same guard for half the suite time


def test_default_recipe_reproduces_the_golden_loss_curve(tmp_path):
    expected = {step: loss for step, loss in golden.load().items() if step <= COMPARED_STEPS}
    measured = golden.produce(tmp_path, stop_after=COMPARED_STEPS)
    assert sorted(measured) == sorted(expected) == list(range(1, COMPARED_STEPS + 1))
    worst = max(abs(measured[s] - expected[s]) / expected[s] for s in expected)
    assert worst <= TOLERANCE, f"max rel diff {worst:.2e}; if intended, run `python -m tests.golden`"
