"""Process groups and where 4D parallelism is applied (TP, PP, CP, DP and DDP wrapping), and the CPU rehearsal that runs megatron-core's CUDA paths on gloo."""
