"""The repairs of megatron-core 0.19.2's fully reshardable and dp_reshardable optimizer saves
(checkpoint/optimizer_format.py), on the grad-buffer layout megatron-core builds (the planner's model of it,
tests/unit/test_planner.py)."""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

from megatron_ext.checkpoint.optimizer_format import padding_within_buckets, placed_at_bucket_offsets
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


def _shard(key: str, offset: int, size: int, total: int) -> ShardedTensor:
    return ShardedTensor(key, torch.zeros(size), torch.float32, (size,), (total,), (offset,), None,
                         replica_id=(0, 0, 0))


def test_a_padding_shard_past_its_buckets_tensor_is_cut_at_its_end_and_nothing_else_is():
    """The geometry of the hidden-200 tied PP2 run: the last parameter ends at 274056, the bucket's tensor (its
    unpadded size, the shared embedding's aligned start) at 274112, the rank's slice at 274176."""
    bucket = [
        {"param": _shard("b0.param", 0, 274056, 274112), "padding": LocalNonpersistentObject(False)},
        {"param": _shard("b0.param", 274056, 120, 274112), "exp_avg": _shard("b0.exp_avg", 274056, 120, 274112),
         "padding": LocalNonpersistentObject(True)},
    ]
    cut = padding_within_buckets({"param_state": {0: {"fp32": [bucket]}}, "other": 3})["param_state"][0]["fp32"][0]
    assert cut[0]["param"] is bucket[0]["param"]
    for key in ("param", "exp_avg"):
        shard = cut[1][key]
        assert (shard.global_offset, shard.local_shape, shard.data.shape) == ((274056,), (56,), (56,)), key
    inside = {"param": _shard("b1.param", 64, 40, 128), "padding": LocalNonpersistentObject(True)}
    assert padding_within_buckets([inside])[0]["param"] is inside["param"]  # within its tensor: left as it is
