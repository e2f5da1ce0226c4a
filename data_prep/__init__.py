"""Offline data preparation: corpus, sentencepiece tokenizer and Megatron .bin/.idx datasets."""
