"""The repair of megatron-core 0.19.2's fully reshardable optimizer save (checkpoint/optimizer_format.py), on the
grad-buffer layout megatron-core builds (the planner's model of it, tests/unit/test_planner.py)."""

from __future__ import annotations

import torch

from megatron_ext.checkpoint.optimizer_format import placed_at_bucket_offsets
from megatron_ext.planner.static_memory import _ddp_buckets


def test_each_parameters_state_is_cut_where_its_buffer_holds_it():
    # 3 DP ranks: bucket ends padded to 384; reversed, 100 → [0, 100), 3 → [128, 131), the shared 50 → [384, 434)
    buckets = _ddp_buckets([(50, True), (3, False), (100, False)], dp_cp=3, distopt=True, bucket_size=None)
    state = {(a, b): torch.arange(a, b, dtype=torch.float32) + 0.5 for _, _, members in buckets for a, b in members}
    # what get_parameter_state_dp_zero gathers: each bucket's elements up to its last parameter's end, packed
    packed = torch.cat([_filled(start, members, state) for start, _, members in buckets])
    # megatron-core 0.19.2 cuts the shared parameter at [384, 434): past the packed 131 + 50 elements, so it saves zeros
    assert packed.numel() == 181
    unpadded = [(start, members[-1][1] - start) for start, _, members in buckets]
    placed = placed_at_bucket_offsets(packed, unpadded, buckets[-1][1])
    for (a, b), values in state.items():
        assert torch.equal(placed[a:b], values), (a, b)


def _filled(start: int, members: list[tuple[int, int]], state: dict) -> torch.Tensor:
    bucket = torch.zeros(members[-1][1] - start)
    for a, b in members:
        bucket[a - start:b - start] = state[a, b]
    return bucket
