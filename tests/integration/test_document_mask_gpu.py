"""Document masking on a GPU: compiled FlexAttention with the block mask (what SDPAttention runs there) gives the
outputs and gradients of SDPA with the dense boolean mask, and a 1-GPU run with masking trains in the local layers
and, where TransformerEngine is installed, in TE's packed-sequence (THD) attention. Needs a GPU; on CPU
the masking is proven in tests/integration/test_document_mask.py (dense mask, ring attention)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.model.document_mask import flex_document_attention, visible
from megatron_ext.model.llama import transformer_engine_available
from tests.launch import ONE_GPU_SMALL, read_scalars, run_pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's kernels need a GPU")


def test_flex_attention_matches_the_dense_mask_forward_and_backward():
    torch.manual_seed(0)
    s = 4096
    documents = torch.repeat_interleave(torch.arange(5), torch.tensor([700, 1300, 96, 1500, 500]))[None].cuda()
    documents = documents.to(torch.int32)
    q = torch.randn(1, 8, s, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 4, s, 64, device="cuda", requires_grad=True) for _ in range(2))
    probe = torch.randn(1, 8, s, 64, device="cuda")
    out = flex_document_attention(q, k, v, documents, 64 ** -0.5, grouped_query=True)
    (out * probe).sum().backward()
    flex_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    positions = torch.arange(s, device="cuda")
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible(documents, positions, positions), scale=64 ** -0.5, enable_gqa=True)
    (dense * probe).sum().backward()
    assert (out - dense).abs().max() / dense.abs().max() < 1e-3
    for got, want in zip(flex_grads, (q.grad, k.grad, v.grad)):
        assert (got - want).abs().max() / want.abs().max() < 1e-3


@pytest.mark.parametrize("backend, attention", [("local", "FlexAttention's block mask"),
                                                ("te", "TransformerEngine's packed-sequence (THD) attention")])
def test_a_run_with_document_masking_trains(backend, attention, tmp_path):
    if backend == "te" and not transformer_engine_available():
        pytest.skip("TransformerEngine is not installed: its packed-sequence attention is untested here")
    tb = tmp_path / "tb"
    proc = run_pretrain(1, [*ONE_GPU_SMALL, f"model.attention_backend={backend}", "data.reset_attention_mask=true",
                            "data.reset_position_ids=true", f"logging.tensorboard_dir={tb}"])
    assert f"attention within each document ({attention})" in proc.stdout, proc.stdout[-3000:]
    losses = read_scalars(tb, "train/lm_loss")
    assert losses[max(losses)] < losses[1], losses
