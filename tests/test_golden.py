"""The default recipe's first 20 losses equal the committed golden curve (regenerate: python -m tests.golden)."""

from __future__ import annotations

import pytest

from tests import golden

pytestmark = pytest.mark.slow

# Same machine kind, same torch and data: the run is deterministic and matches bit for bit;
# the bound only absorbs a different CPU instruction set choosing other kernels.
TOLERANCE = 1e-5


def test_default_recipe_reproduces_the_golden_loss_curve(tmp_path):
    expected = golden.load()
    measured = golden.produce(tmp_path)
    assert sorted(measured) == list(range(1, golden.STEPS + 1))
    worst = max(abs(measured[s] - expected[s]) / expected[s] for s in expected)
    assert worst <= TOLERANCE, f"max rel diff {worst:.2e}; if intended, run `python -m tests.golden`"
