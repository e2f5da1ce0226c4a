"""Training data: tokenizers, megatron-core GPTDatasets from a blend, and per-data-parallel-rank micro-batch iterators."""
