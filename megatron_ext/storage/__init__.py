"""Where a run's files live: a local file system, or object storage through NVIDIA's multi-storage-client."""
