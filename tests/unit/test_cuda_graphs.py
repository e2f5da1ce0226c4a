"""train.cuda_graphs without a GPU: megatron-core's layer graphs are asked for, and their RNG streams checkpoint
as plain state tensors."""

from __future__ import annotations

import warnings

import torch

from megatron_ext.checkpoint.rng import tracker_states_as_tensors
from megatron_ext.config.schema import load_config
from megatron_ext.model.llama import transformer_config


def test_transformer_config_asks_megatron_core_for_whole_layer_graphs_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # megatron-core's default scope "full" warns that it is deprecated
        graphed = transformer_config(load_config(None, ["train.cuda_graphs=true"]), on_gpu=True, use_te=False)
        eager = transformer_config(load_config(None, []), on_gpu=True, use_te=False)
    assert (graphed.cuda_graph_impl, graphed.cuda_graph_modules) == ("local", [])  # [] = the whole layer
    assert eager.cuda_graph_impl == "none"


def test_graph_safe_rng_streams_are_saved_as_state_tensors():
    """Under CUDA graphs megatron-core's tracker holds torch.Generators; a checkpoint keeps their state tensors,
    which load into a run with or without graphs (set_rng_state converts them back for a graphed run)."""
    stream = torch.Generator().manual_seed(7)
    saved = tracker_states_as_tensors({"model-parallel-rng": stream, "data-parallel-rng": stream.get_state()})
    expected = torch.Generator().manual_seed(7).get_state()
    assert all(isinstance(s, torch.Tensor) and torch.equal(s, expected) for s in saved.values())




