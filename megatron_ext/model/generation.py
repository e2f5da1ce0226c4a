"""Sampling text from a GPTModel: greedy, or temperature with top-k / top-p (nucleus) filtering.

The filters are transformers' own logits warpers (the ones ``model.generate`` applies), so a sample here means what
it means there. Each new token runs the whole (windowed) sequence through the model, without a KV cache: this is for
looking at what a checkpoint writes, not for serving (export it with ``recipes.convert export-hf`` for that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy (the most likely token each step)
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p; 1 = all


def next_token(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator] = None) -> int:
    """One token id from the last position's `logits` ([vocab], padded rows already cut off)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = logits.float().unsqueeze(0)
    if sampling.temperature <= 0:
        return int(logits.argmax(dim=-1))
    scores = TemperatureLogitsWarper(sampling.temperature)(None, logits)
    if sampling.top_k > 0:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return int(torch.multinomial(scores.softmax(dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, vocab_size: int, seq_length: int,
             sampling: Sampling, stop_token: Optional[int] = None, seed: int = 0) -> list[int]:
    """The tokens `model` (one GPTModel chunk holding every layer) writes after `prompt`; the context is the last
    `seq_length` tokens, as in training. Stops after `max_new_tokens` or at `stop_token`."""
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    device = next(model.parameters()).device
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-seq_length:]], dtype=torch.long, device=device)
        positions = torch.arange(window.shape[1], device=device).unsqueeze(0)
        logits = model(window, positions, attention_mask=None)  # [1, s, padded vocab]
        token = next_token(logits[0, -1, :vocab_size].cpu(), sampling, generator)
        tokens.append(token)
        if token == stop_token:
            break
    return tokens[len(prompt):]
