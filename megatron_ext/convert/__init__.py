"""Hugging Face Llama checkpoints and configs to and from this project's megatron-core model."""
