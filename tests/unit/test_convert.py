"""The converter's pure pieces: the layout a saved run is rebuilt under."""

from __future__ import annotations

from pathlib import Path

from megatron_ext.config.schema import load_config
from megatron_ext.config.validate import validate_layout
from recipes import convert
from tests.launch import TINY


def test_the_layout_a_checkpoint_is_loaded_under_is_a_valid_recipe():
    """export-hf and the logit checks rebuild the saved run under another layout: that config passes validation."""
    saved = convert.SavedCheckpoint(Path("ckpt/iter_0000001"), load_config(TINY, ["data.mock=true",
                                    "model.vocab_size=1000"]), 1000, 1024, "training_state")
    for tp, pp in [(1, 1), (2, 2)]:
        validate_layout(convert.layout_config(saved, tp, pp), world_size=tp * pp)


