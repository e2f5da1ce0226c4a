"""Throughput and run logging: FLOPs and MFU, the per-step console line, TensorBoard scalars."""
