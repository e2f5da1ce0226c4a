"""RNG states in a checkpoint: Python's, torch's CPU and CUDA generators, and megatron-core's tracker streams."""

from __future__ import annotations

import random
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import convert_cuda_rng_state


def local_rng_state() -> dict[str, Any]:
    """This rank's RNG states."""
    return {
        "random_rng_state": random.getstate(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tracker_states_as_tensors(tensor_parallel.get_cuda_rng_tracker().get_states()),
    }


def rng_state() -> ShardedObject:
    """Per-(PP, TP) rank RNG states for dist_checkpointing; DP replicas hold the same streams, so only DP rank 0
    saves."""
    ps = parallel_state
    return ShardedObject(
        "rng_state",
        [local_rng_state()],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def set_rng_state(rng: list[dict[str, Any]]) -> None:
    """Restore what `rng_state` saved; the tracker streams in the form this run's tracker uses (graph-safe or not)."""
    state = rng[0]
    random.setstate(state["random_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state["cuda_rng_state"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    graph_safe = getattr(tracker, "use_cudagraphable_rng", False)
    tracker.set_states({name: convert_cuda_rng_state(stream, to_graphable=graph_safe)
                        for name, stream in state["rng_tracker_states"].items()})


def tracker_states_as_tensors(states: dict[str, Any]) -> dict[str, Any]:
    """The RNG tracker's streams as state tensors: under CUDA graphs they are graph-safe torch.Generators, which
    a checkpoint could not load into a run without graphs (or a later torch); as tensors they load into either."""
    return {name: convert_cuda_rng_state(stream, to_graphable=False) for name, stream in states.items()}
