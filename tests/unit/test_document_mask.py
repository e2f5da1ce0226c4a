"""Document masking's pieces: document ids from EOD, which keys a query sees, FlexAttention's block mask against the
same rule, TransformerEngine's packed-sequence segments, the pre-launch refusals and the planner's count of the
mask (the model-level proof is tests/integration/test_document_mask.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import planner
from megatron_ext.config.schema import load_config
from megatron_ext.config.validate import validate_layout
from megatron_ext.data.datasets import _WithDocumentIds, document_ids
from megatron_ext.errors import ConfigError
from megatron_ext.model.document_mask import pack_documents, visible
from tests.launch import ROOT


def test_an_eod_belongs_to_the_document_it_ends():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9], [0, 0, 3, 4, 5, 6]])
    assert document_ids(tokens, eod=0).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    batch = _WithDocumentIds(eod=0)([{"tokens": row, "labels": row} for row in tokens])
    assert batch["documents"].tolist() == document_ids(tokens, 0).tolist() and batch["tokens"].shape == (2, 6)


def test_a_query_sees_its_own_documents_earlier_keys_only():
    documents = torch.tensor([[0, 0, 1, 1]])
    positions = torch.arange(4)
    allowed = visible(documents, positions, positions)[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    # a block of the ring attention: late query positions 2-3 against keys 0-1, no causal cut
    assert visible(documents, positions[2:], positions[:2], causal=False)[0, 0].any().item() is False
    assert visible(None, positions, positions, causal=False) is None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flexattentions_block_mask_draws_the_same_boundaries():
    """Forward only (FlexAttention has no backward pass on CPU): the block mask's rule against SDPA with the boolean
    mask, across block boundaries (block 128, documents of 100/200/212 tokens)."""
    from torch.nn.attention.flex_attention import flex_attention

    from megatron_ext.model.document_mask import _block_mask

    torch.manual_seed(0)
    s = 512
    documents = torch.tensor([[0] * 100 + [1] * 200 + [2] * 212], dtype=torch.int32)
    q, k, v = (torch.randn(1, 2, s, 16) for _ in range(3))
    flex = flex_attention(q, k, v, block_mask=_block_mask(documents))
    positions = torch.arange(s)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible(documents, positions,
                                                                                        positions))
    assert (flex - dense).abs().max() < 1e-5
    assert _block_mask(documents) is _block_mask(documents)  # built once per micro batch, shared by the layers


def test_transformer_engines_segments_are_each_sequences_documents():
    """A micro batch of two sequences becomes one row; segments start at each document and at each sequence, also
    where the second sequence's first document has the id the first one's last document has (no EOD between)."""
    tokens = torch.tensor([[5, 0, 7, 8, 9, 9], [4, 4, 4, 0, 3, 0]])
    documents = document_ids(tokens, eod=0)  # [[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
    batch, packed = pack_documents({"tokens": tokens, "labels": tokens + 1}, documents)
    assert batch["tokens"].tolist() == [tokens.flatten().tolist()] and batch["labels"].shape == (1, 12)
    assert packed.qkv_format == "thd" and packed.cu_seqlens_q.dtype == torch.int32
    assert packed.cu_seqlens_q.tolist() == packed.cu_seqlens_kv.tolist() == [0, 2, 6, 10, 12]
    assert packed.max_seqlen_q == packed.max_seqlen_kv == 4


@pytest.mark.parametrize("overrides, fragment", [
    (["model.attention_backend=te", "data.reset_position_ids=true", "parallel.tensor_model_parallel_size=1",
      "parallel.sequence_parallel=false", "parallel.context_parallel_size=2"], "padded to a multiple of 2·CP"),
    (["model.attention_backend=te"], "restarts RoPE at every document: set data.reset_position_ids=true"),
    (["train.cuda_graph_impl=local"], "changes it with every micro batch"),
])
def test_combinations_not_wired_are_refused_before_launch(overrides, fragment):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["data.reset_attention_mask=true", *overrides])
    with pytest.raises(ConfigError, match=fragment):
        validate_layout(cfg, 4, te_available=True, compute_capability=(9, 0))


def test_auto_layers_take_transformer_engines_packed_sequences_where_it_imports():
    from megatron_ext.config.kernels import resolve_kernel_options

    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["data.reset_attention_mask=true"])
    with pytest.raises(ConfigError, match="so model.attention_backend=auto builds its layers"):
        resolve_kernel_options(cfg, on_gpu=True, use_te=True)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["data.reset_attention_mask=true",
                                                      "data.reset_position_ids=true"])
    assert resolve_kernel_options(cfg, on_gpu=True, use_te=True).model.attention_backend == "te"
    assert resolve_kernel_options(cfg, on_gpu=True, use_te=False).model.attention_backend == "local"


def test_the_planner_counts_the_block_mask_not_an_s_squared_one():
    cfg = load_config(ROOT / "configs" / "llama3_8b_8gpu_bf16.yaml")
    masked = load_config(ROOT / "configs" / "llama3_8b_8gpu_bf16.yaml", ["data.reset_attention_mask=true"])
    extra = planner.stage_peak_bytes(masked, 128256, 8, 0) - planner.stage_peak_bytes(cfg, 128256, 8, 0)
    seq, mbs = cfg.model.seq_length, cfg.train.micro_batch_size
    assert 0 < extra < 0.01 * mbs * seq * seq  # a dense bool mask would be mbs·s² bytes
