"""Facts about the model megatron-core builds from a recipe (a function for the `megatron` fixture's spawned world of
one): what the shape's and planner's counts are held against (tests/unit/test_mla.py, test_gpt_oss.py)."""

from __future__ import annotations

import torch

from megatron_ext.config.schema import load_config
from tests.launch import TINY


def built_model_facts(overrides: list[str], vocab: int) -> dict:
    """configs/tiny.yaml with `overrides`, built in one process: its parameter count, each layer's parameter sizes
    (experts apart) and whether it is an MoE layer, the first layer's expert parameter sizes, the order of the
    non-expert ones, each layer's attention window and the first one's softmax scale, and one training
    forward/backward pass's loss and whether every parameter got a gradient."""
    from megatron.core import tensor_parallel

    from recipes.saved_model import build_model, model_parallel_world

    cfg = load_config(TINY, overrides)
    with model_parallel_world(cfg):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = build_model(cfg, vocab).train()
        tokens = torch.randint(0, vocab, (2, cfg.model.seq_length))
        loss = model(tokens, None, attention_mask=None, labels=tokens).mean()
        loss.backward()
        layers = model.decoder.layers
        return {"parameters": sum(p.numel() for p in model.parameters()),
                "layers": [[p.numel() for n, p in layer.named_parameters() if ".experts." not in f".{n}"]
                           for layer in layers],
                "moe_layers": [hasattr(layer.mlp, "router") for layer in layers],
                "experts": [p.numel() for n, p in layers[0].named_parameters() if ".experts." in f".{n}"],
                "named": [p.numel() for n, p in model.named_parameters() if ".experts." not in n],
                "windows": [layer.self_attention.core_attention.window for layer in layers],
                "softmax_scale": layers[0].self_attention.core_attention.softmax_scale,
                "loss": loss.item(), "all_have_gradients": all(p.grad is not None for p in model.parameters())}


def assert_the_planner_counts_what_was_built(built: dict, cfg, vocab: int) -> None:
    """`built` (:func:`built_model_facts`) held to the shape's and the planner's counts of `cfg`: the parameters,
    each layer's (experts apart), every parameter but the experts' in the order megatron-core's buffers lay them out
    (the MTP layers' too), and one training pass at initialisation (every parameter with a gradient, loss ≈ ln V)."""
    import math

    from megatron_ext.config.shape import ModelShape
    from megatron_ext.planner.layout import RankShape
    from megatron_ext.planner.static_memory import chunk_params

    shape, rank = ModelShape.of(cfg.model), RankShape.of(cfg, vocab)
    assert built["parameters"] == shape.num_parameters(vocab)
    assert built["layers"] == [rank.layer_params(shape.is_moe_layer(layer)) for layer in range(shape.num_layers)]
    assert built["named"] == [n for n, _ in chunk_params(rank, 1, range(shape.num_layers), True, True)]
    assert built["all_have_gradients"] and abs(built["loss"] - math.log(vocab)) < 0.8, built["loss"]
