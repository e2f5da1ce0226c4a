"""Plain sentences on why a layout costs what it costs."""

from __future__ import annotations

from megatron_ext.config.schema import ZERO_LEVEL, expert_data_parallel_size
from megatron_ext.hardware import GPUSpec
from megatron_ext.planner.estimate import FRAGMENTATION, Estimate
from megatron_ext.planner.layout import GIB


def explain(e: Estimate, gpu: GPUSpec) -> str:
    """A few plain sentences on why this layout costs what it costs."""
    L, t, mem = e.layout, e.time, e.memory
    parts = [f"{L.label()}: {t['step']:.2f} s/step, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
             f"MFU ≈ {100 * e.mfu:.0f} %, {mem['total'] / GIB:.1f} of {gpu.memory_gib:.0f} GiB "
             f"(pipeline stage {e.peak_stage})."]
    if L.tp > 1:
        parts.append(f"TP{L.tp} splits every layer across {L.tp} GPUs of one node"
                     + (" and sequence parallelism also splits norms and dropout-free residual activations"
                        if L.sp else "") + f"; its collectives cost {t['tp_comm']:.2f} s.")
    if L.pp > 1:
        parts.append(f"PP{L.pp}{f' with {L.vpp} virtual stages' if L.vpp else ''} leaves a bubble of "
                     f"{t['pp_bubble']:.2f} s ((p−1)/(v·m) = {L.pp - 1}/({L.vpp or 1}·"
                     f"{e.num_microbatches})).")
    if L.cp > 1:
        parts.append(f"CP{L.cp} splits each sequence in {L.cp}; the K/V ring costs {t['cp_comm']:.2f} s "
                     "beyond what attention hides.")
    if L.ep > 1 or L.etp is not None:
        etp = L.tp if L.etp is None else L.etp
        expert_dp = expert_data_parallel_size(L.tp * L.cp * L.dp * L.pp, L.pp, L.ep, etp)
        parts.append(f"EP{L.ep} puts 1/{L.ep} of each layer's experts on a GPU"
                     + (f", each expert's matrices split over ETP{etp}" if etp > 1 else ", each expert whole")
                     + f"; the tokens' all-to-all dispatch and combine cost {t['moe_comm']:.2f} s, and the experts' "
                     f"gradients and optimizer state are reduced and sharded over expert-DP={expert_dp}.")
    over = f"DP×CP={L.dp * L.cp}" if L.replicas == 1 else f"HSDP groups of {L.dp * L.cp // L.replicas} DP×CP ranks"
    shard = f"sharded over {over}" if L.distopt and L.dp * L.cp > 1 else "replicated"
    if L.offload:
        shard = f"{1 - L.offload:.0%} of it on the GPU, {shard}"
    if L.sharding:
        level = ZERO_LEVEL[L.sharding]
        shard += (f"; Megatron-FSDP ZeRO-{level} shards the gradients"
                  + (" and the parameters, gathering two layers at a time," if level == 3 else "") + " there too")
    parts.append(f"Optimizer state {mem['optimizer'] / GIB:.1f} GiB ({shard}); "
                 f"params {mem['params'] / GIB:.1f}, "
                 f"grads {mem['grads'] / GIB:.1f}, activations {mem['activations'] / GIB:.1f} GiB "
                 f"with recompute={L.recompute or 'none'} and micro batch {L.mbs}; DP gradient sync exposes "
                 f"{t['dp_comm']:.2f} s.")
    if L.replicas > 1:
        parts.append(f"HSDP keeps the sharding's gathers inside each of the {L.replicas} groups; the groups replicate "
                     "each other and all-reduce their gradient shards once per step.")
    if L.offload:
        parts.append(f"Optimizer CPU offload keeps {L.offload:.0%} of this rank's optimizer state in host memory "
                     f"({mem['host'] / GIB:.1f} GiB of the host's {gpu.host_memory_gib:.0f} GiB per GPU); the host's "
                     f"Adam step and the "
                     f"PCIe copies add {t['offload']:.2f} s (uncalibrated).")
    if L.offload and e.without_offload is not None:
        parts.append(f"Without offload this layout needs {e.without_offload['total'] / GIB:.1f} GiB/GPU (optimizer "
                     f"state {e.without_offload['optimizer'] / GIB:.1f} GiB) and nothing fits without it.")
    zero1 = e.without_sharding
    if L.sharding and zero1 is not None:
        verdict = "does not fit" if zero1["total"] * (1 + FRAGMENTATION) > e.gpu_memory else "would fit too"
        parts.append(f"With ZeRO-1 this layout needs {zero1['total'] / GIB:.1f} GiB/GPU (params "
                     f"{zero1['params'] / GIB:.1f}, grads {zero1['grads'] / GIB:.1f}, optimizer state "
                     f"{zero1['optimizer'] / GIB:.1f} GiB) and {verdict}; ZeRO-{level} over {over} "
                     f"brings params and grads to {mem['params'] / GIB:.1f} + {mem['grads'] / GIB:.1f} GiB.")
    return " ".join(parts)
