"""What recipes.generate's --temperature, --top-k, --top-p and --seed do, observed through `generate` on a stand-in
model whose next-token distribution is known: greedy takes the argmax, temperature sharpens or flattens the
distribution as softmax(logits/T), top-k and top-p never sample outside their set, the same seed writes the same
tokens and another seed others, and the padded vocabulary rows are never sampled."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.model.generation import Sampling, generate

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 9.0])  # 5 real tokens and one padded row (never a token)
VOCAB = 5


class _FixedNextToken(torch.nn.Module):
    """A GPTModel stand-in: the same logits at every position, whatever the input."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens, positions, attention_mask=None):
        return LOGITS.expand(tokens.shape[0], tokens.shape[1], -1)


def _sample(sampling: Sampling, n: int = 4000, seed: int = 0) -> list[int]:
    return generate(_FixedNextToken(), [0], n, VOCAB, seq_length=8, sampling=sampling, seed=seed)


def _frequencies(tokens: list[int]) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(VOCAB)]


def test_greedy_takes_the_most_likely_real_token():
    assert _sample(Sampling(), n=5) == [0] * 5  # the padded row's 9.0 is cut off


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_logits_over_t(temperature):
    expected = torch.softmax(LOGITS[:VOCAB] / temperature, dim=0).tolist()
    seen = _frequencies(_sample(Sampling(temperature=temperature)))
    for p, f in zip(expected, seen):  # 4000 draws: within 4 standard errors
        assert abs(f - p) <= 4 * math.sqrt(p * (1 - p) / 4000) + 1e-3, (temperature, expected, seen)


def test_top_k_and_top_p_never_sample_outside_their_set():
    assert set(_sample(Sampling(temperature=2.0, top_k=2))) == {0, 1}
    probs = torch.softmax(LOGITS[:VOCAB], dim=0)  # 0.56, 0.21, 0.13, 0.08, 0.03: 0.85 needs the first three
    assert probs[:2].sum() < 0.85 <= probs[:3].sum()
    assert set(_sample(Sampling(temperature=1.0, top_p=0.85))) == {0, 1, 2}


def test_the_seed_decides_the_sample():
    sampling = Sampling(temperature=1.5)
    assert _sample(sampling, n=50, seed=7) == _sample(sampling, n=50, seed=7)
    assert _sample(sampling, n=50, seed=7) != _sample(sampling, n=50, seed=8)


def test_generation_stops_at_the_stop_token():
    assert generate(_FixedNextToken(), [3], 10, VOCAB, 8, Sampling(), stop_token=0) == [0]
