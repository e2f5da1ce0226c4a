"""Checkpoints through megatron-core dist_checkpointing: the directory layout, save and load, asynchronous writes,
manifests, retention, the optimizer format, RNG state, checkpoint compatibility across layer specs, where a run
resumes, and the lock that keeps one run per checkpoint directory."""
