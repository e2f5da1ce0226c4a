"""The planner's activation memory against the published formula it refines: Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", Table 2 (bytes per transformer layer with 16-bit activations,
s sequence, b micro batch, h hidden, a heads, t tensor parallel), for no parallelism, TP, TP+SP, TP+SP with
selective recompute and full recompute.

The paper's layer is GPT-3's (LayerNorm, MHA, 4h GeLU MLP, dropout, attention that keeps its s² scores); this
project's is Llama's. Each difference is named and sized here, and the planner's count must equal the paper's plus
exactly those differences: a term lost or added anywhere in `layer_activation_bytes` fails the equality."""

from __future__ import annotations

import pytest

from megatron_ext.config.schema import load_config
from megatron_ext.planner.activations import layer_activation_bytes
from tests.launch import TINY

S, B, H, A, F = 1024, 2, 1024, 16, 2816  # a Llama-style SwiGLU width (~8h/3, rounded), MHA


def korthikanti_table_2(t: int, sp: bool, recompute: str | None) -> float:
    """Bytes per layer and micro batch, as the paper's Table 2 gives them."""
    s, b, h, a = S, B, H, A
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if recompute == "selective":  # the paper's selective recompute assumes sequence parallelism
        return s * b * h * 34 / t
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if not sp:
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return s * b * h * (34 / t + 5 * a * s / (h * t))


def differences(t: int, sp: bool, recompute: str | None) -> dict[str, float]:
    """What this project's layer saves beyond (or instead of) the paper's, by cause."""
    tokens, shard = S * B, (t if sp else 1)
    if recompute == "full":
        return {}
    flash = {"no s² scores, softmax or attention-dropout mask: flash attention": -5 * A * S * S * B / t,
             "flash attention's fp32 log-sum-exp per head": 4 * A * tokens / t}
    if recompute == "selective":  # the scores' recompute keeps q, k, v as the paper's does; the lse goes too
        flash = {"megatron-core's int32 mask-type tensor in the checkpoint": 4}
    return {
        **flash,
        "no dropout masks after attention and MLP (Llama trains without dropout)": -2 * tokens * H / shard,
        "an fp32 rstd per token for each of the two RMSNorms": 2 * 4 * tokens / shard,
        "RoPE'd q and k kept beside the fused QKV output": 2 * 2 * H * tokens / t,
        "SwiGLU (fc1 out 2f, silu, gate product, fc2 in: 5f) instead of a 4h GeLU MLP (8h)":
            2 * (5 * F - 8 * H) * tokens / t,
        "RoPE's cos and sin for q and k": 4 * S * (H // A) * 2,
    }


@pytest.mark.parametrize("t, sp, recompute", [(1, False, None), (4, False, None), (4, True, None),
                                              (4, True, "selective"), (1, False, "full"), (4, True, "full")])
def test_the_layer_activations_are_korthikantis_table_2_plus_the_named_differences(t, sp, recompute):
    cfg = load_config(TINY, [f"model.hidden_size={H}", f"model.num_attention_heads={A}",
                             f"model.num_query_groups={A}", f"model.ffn_hidden_size={F}", f"model.seq_length={S}",
                             f"train.micro_batch_size={B}", "train.precision=bf16",
                             f"parallel.tensor_model_parallel_size={t}", f"parallel.sequence_parallel={str(sp).lower()}",
                             f"train.recompute_granularity={recompute or 'null'}"])
    expected = korthikanti_table_2(t, sp, recompute) + sum(differences(t, sp, recompute).values())
    assert layer_activation_bytes(cfg) == expected
