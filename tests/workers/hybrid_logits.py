"""GPTModel against HybridModel on the same weights (a function for the `megatron` fixture's spawned world of one):
what tests/unit/test_hybrid.py holds equal."""

from __future__ import annotations

import torch


def largest_logit_difference(overrides: list[str], vocab: int) -> tuple[float, float]:
    """configs/tiny.yaml with `overrides` built as a GPTModel and as a HybridModel in one process, the hybrid given
    the GPT model's weights under its own names (checkpoint/model_class.py's mapping): the largest difference of
    their logits on random tokens, and the largest logit."""
    from megatron.core import tensor_parallel

    from megatron_ext.checkpoint.model_class import gpt_parameter_name
    from megatron_ext.config.schema import load_config
    from recipes.saved_model import build_model, model_parallel_world
    from tests.launch import TINY

    cfg = load_config(TINY, overrides)
    with model_parallel_world(cfg):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        gpt = build_model(cfg, vocab)
        hybrid = build_model(load_config(TINY, [*overrides, "model.model_class=hybrid"]), vocab)
        weights = gpt.state_dict()
        hybrid.load_state_dict({name: weights[gpt_parameter_name(name, hybrid=True)] for name in hybrid.state_dict()})
        tokens = torch.randint(0, vocab, (2, cfg.model.seq_length))
        with torch.no_grad():
            expected, got = gpt(tokens, None, attention_mask=None), hybrid(tokens, None, attention_mask=None)
        return (got - expected).abs().max().item(), expected.abs().max().item()
