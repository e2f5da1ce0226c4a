"""The recipe with megatron-core 0.19.2's fully reshardable optimizer save as it is, without the repair of
checkpoint/optimizer_format.py: it writes the checkpoints that save wrote before that repair."""

from __future__ import annotations

import contextlib

from megatron_ext.checkpoint import save_load
from recipes.pretrain import entry_point

if __name__ == "__main__":
    save_load.state_in_buffer_layout = lambda _optimizer: contextlib.nullcontext()
    entry_point()
