"""Offline data preparation: corpus, sentencepiece tokenizer and Megatron .bin/.idx datasets."""

import megatron_ext  # noqa: F401  (silences megatron-core's import-time TE/Apex warnings)
