"""Training data: tokenizers and how a dataset was tokenized, the data checks before launch, megatron-core
GPTDatasets from a blend, and per-data-parallel-rank micro-batch iterators."""
