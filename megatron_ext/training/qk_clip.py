"""QK-clip (MuonClip) in the loop: after each optimizer step, megatron-core's ``clip_qk`` scales down the query and
key weights of every head whose largest attention logit in the step passed model.qk_clip_threshold (the logits are
recorded by the core attention: TE's, or :mod:`megatron_ext.model.attention`'s)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer.qk_clip import clip_qk


def _as_megatron_lm_chunks(models: list[GPTModel]) -> list[SimpleNamespace]:
    """megatron-core's clip_qk reaches the decoder through Megatron-LM's two wrappers (DDP around Float16Module);
    this project's chunks are DDP around the model."""
    return [SimpleNamespace(module=SimpleNamespace(module=model)) for model in models]


def forget_max_logits(models: list[GPTModel]) -> None:
    """Drop the logits a skipped step recorded: the next step's clip sees its own only."""
    for model in models:
        for layer in model.decoder.layers:
            core = layer.self_attention.core_attention
            if hasattr(core, "current_max_attn_logits"):
                core.current_max_attn_logits = None


def clip_after_update(models: list[GPTModel]) -> float:
    """megatron-core's clip_qk on the updated weights (the largest logit over DP×CP); returns that logit."""
    return clip_qk(_as_megatron_lm_chunks(models))
