"""Where 4D parallelism is applied: process groups, seeds, DDP wrapping, and the printed layout."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer, tag_params_for_buffer_routing
from megatron.core.optimizer.param_layout import FullParamLayout
from megatron.core.transformer import TransformerConfig

from megatron_ext.config.schema import (
    ZERO_LEVEL,
    RecipeConfig,
    collective_timeout_minutes,
    ddp_bucket_size,
    expert_data_parallel_size,
    expert_tensor_parallel_size,
)
from megatron_ext.distributed import cpu_backend
from megatron_ext.distributed.store_keys import process_group_namespace


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _restarted_world_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The process group's store after torchrun's agent restarted the workers (``--max-restarts``, an elastic
    membership change), else None (torch's default). The agent keeps one store for all its worlds (torch shares
    the rendezvous' TCPStore), and the previous world's process-group keys are still in it: the new ranks read them
    and wait in ``init_process_group`` for ranks that are gone (seen on CPU/gloo, 3 of 3 restarts after a lost
    node). Each restart gets its own key space."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(process_group_namespace(restart), store)


def device() -> torch.device:
    """This rank's device: its GPU, or the CPU in rehearsal."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def rng_tracker_options(cfg: RecipeConfig, on_gpu: bool, use_te: bool) -> dict[str, bool]:
    """megatron-core's RNG tracker for `cfg`'s CUDA graphs, as Megatron-LM chooses it: graph-safe streams under any
    graphs (megatron-core's layer graphs refuse any other tracker), and TransformerEngine's tracker where TE's layers
    are built (`use_te`) or its graphs capture them."""
    graphs = on_gpu and cfg.train.cuda_graph_impl != "none"
    return {"te_rng_tracker": graphs and (use_te or cfg.train.cuda_graph_impl == "transformer_engine"),
            "use_cudagraphable_rng": graphs}


def init_distributed(cfg: RecipeConfig, on_gpu: bool, use_te: bool = False) -> None:
    """Process group (NCCL on GPU, gloo in CPU rehearsal), megatron-core's TP/CP/DP/PP groups, seeds (`use_te`: the
    run builds TransformerEngine's layers, whose RNG tracker CUDA graphs then use)."""
    p = cfg.parallel
    minutes = collective_timeout_minutes(cfg)
    timeout = datetime.timedelta(minutes=minutes)
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:  # plain `python -m recipes.pretrain`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    if not dist.is_initialized():
        backend = "nccl" if on_gpu else "gloo"
        store = _restarted_world_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        distributed_timeout_minutes=minutes,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size(cfg),
    )
    # Same seed on every rank: megatron's tracker derives the TP-rank-specific streams from it,
    # and CPU-initialised weights come out identical across TP layouts.
    torch.manual_seed(cfg.train.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed, **rng_tracker_options(cfg, on_gpu, use_te))


def destroy_distributed() -> None:
    """Tear down in megatron's order; skipping it can abort distributed-optimizer runs at exit."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def stop_data_parallel_communication(chunks: Sequence[torch.nn.Module]) -> int:
    """Wait for the collectives Megatron-FSDP still has in flight, and return how many parameter all-gathers that
    was: after the optimizer step it starts gathering the updated parameters for the next forward pass (every
    bucket's: 5 in flight at the end of the parity matrix's ZeRO-3 run without a final evaluation, whose forward pass
    would consume them), which nothing else waits for. Destroying the process groups under them is a use-after-free
    in the communication threads: a rank ended by SIGSEGV at the end of a finished ZeRO-3 run (seen twice on CPU/gloo
    in CI). Megatron-FSDP warns about exactly the gathers this waits for, so its warning is silenced here."""
    in_flight = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There are still pending all-gather tasks")
        for chunk in chunks:
            if isinstance(chunk, FullyShardedDataParallel):
                in_flight += len(chunk.module.all_gather_pipeline.param_gather_event_map)
                chunk.stop_communication()
    return in_flight


def gather_from_ranks(values: Sequence[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values`, indexed by rank: one all-gather (collective)."""
    mine = torch.tensor(list(values), dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [row.tolist() for row in out]


def ddp_config(cfg: RecipeConfig) -> DistributedDataParallelConfig:
    """megatron-core's DDP (or Megatron-FSDP) configuration for `cfg`'s data parallelism."""
    p = cfg.parallel
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        bucket_size=p.ddp_bucket_size,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
        fp8_param_gather=cfg.train.fp8_param_gather,  # the parameters kept in FP8 (TransformerConfig.fp8_param)
        # off: megatron_ext/resilience/divergence.py checks the same buffers and names the iteration and rank
        check_for_nan_in_grad=False,
        average_in_collective=False,  # per-token loss: finalize_model_grads divides by the token count
        use_megatron_fsdp=p.use_megatron_fsdp,
        data_parallel_sharding_strategy=p.data_parallel_sharding_strategy if p.use_megatron_fsdp else "no_shard",
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        outer_dp_sharding_strategy=p.outer_dp_sharding_strategy,
    )


def wrap_with_ddp(chunks: list[GPTModel], config: TransformerConfig, cfg: RecipeConfig
                  ) -> list[DistributedDataParallel] | list[FullyShardedDataParallel]:
    """megatron-core DDP around each model chunk (grad buckets, optional overlap, distributed optimizer), or its
    Megatron-FSDP with parallel.use_megatron_fsdp (ZeRO-2/3)."""
    data_parallel = ddp_config(cfg)
    if cfg.parallel.use_megatron_fsdp:
        return _wrap_with_megatron_fsdp(chunks, config, data_parallel)
    layer_wise = cfg.optimizer.name == "muon" and cfg.parallel.use_distributed_optimizer
    if layer_wise:  # Muon's matrices in their own buffers, the Adam-stepped rest in the distributed optimizer's
        tag_params_for_buffer_routing(chunks)
    return [
        DistributedDataParallel(config=config, ddp_config=data_parallel, module=chunk, disable_bucketing=(i > 0),
                                full_param_layout=_layer_wise_layout(chunk, data_parallel, cfg, i > 0) if layer_wise
                                else None)
        for i, chunk in enumerate(chunks)
    ]


def _layer_wise_layout(chunk: GPTModel, data_parallel: DistributedDataParallelConfig, cfg: RecipeConfig,
                       unbucketed: bool) -> FullParamLayout:
    """megatron-core's layer-wise distributed optimizer's layout of `chunk`'s gradient buffers, which DDP must be
    given (it derives only the distributed optimizer's itself): every Muon matrix whole in one DP rank's shard,
    the rest sharded as the distributed optimizer shards it; buckets sized as DDP sizes them (the first chunk of the
    first stage only)."""
    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    first = not unbucketed and parallel_state.get_pipeline_model_parallel_rank() == 0
    bucket = ddp_bucket_size(cfg, dp) if first else None
    params = [param for param in chunk.parameters() if param.requires_grad]
    return LayerWiseDistributedOptimizer.compute_full_param_layout(
        params, bucket, dp, data_parallel,
        expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size())


def _wrap_with_megatron_fsdp(chunks: list[GPTModel], config: TransformerConfig,
                             data_parallel: DistributedDataParallelConfig) -> list[FullyShardedDataParallel]:
    """Megatron-FSDP around each chunk: optimizer state and gradients (and, under optim_grads_params, the
    parameters, gathered per decoder layer) sharded over DP×CP."""
    if torch.cuda.is_available():
        return [FullyShardedDataParallel(config=config, ddp_config=data_parallel, module=chunk) for chunk in chunks]
    # CPU rehearsal: on the CPU on purpose, which Megatron-FSDP would warn about on every rank
    fsdp_log = logging.getLogger(megatron_fsdp.__name__)
    level = fsdp_log.level
    fsdp_log.setLevel(logging.ERROR)
    try:
        with cpu_backend.integer_current_device():
            return [FullyShardedDataParallel(config=config, ddp_config=data_parallel, module=chunk,
                                             device=torch.device("cpu")) for chunk in chunks]
    finally:
        fsdp_log.setLevel(level)


def grad_buffers(chunk: DistributedDataParallel | FullyShardedDataParallel) -> list[torch.Tensor]:
    """The gradients this rank holds for `chunk`: DDP's flat buffers (padding zeroed with them), or under
    Megatron-FSDP each parameter's part of this rank's shard (its buffers' padding is never written)."""
    if isinstance(chunk, FullyShardedDataParallel):
        return [group.main_grad_buffer.get_item(item) for group in chunk.param_and_grad_buffer.parameter_groups
                if group.main_grad_buffer is not None for item in group.main_grad_buffer.item_index_map]
    return [buffer.grad_data for buffer in chunk.buffers + chunk.expert_parallel_buffers]


def describe_sharding(chunks: list[FullyShardedDataParallel]) -> str:
    """What this rank holds under Megatron-FSDP, read from its buffers: parameter and gradient elements against
    the elements of its tensor-parallel part of the model (every parameter's full size in those buffers)."""
    held, whole = {"parameter": 0, "gradient": 0}, 0
    for chunk in chunks:
        for group in chunk.param_and_grad_buffer.parameter_groups:
            whole += sum(index.size for index in group.model_weight_buffer.item_index_map.values())
            # HSDP with the optimizer sharded across replicas keeps each replica's shard (hfsdp_helper_*buf); the
            # main buffers, sharded over all of DP×CP for the optimizer, are views into it
            for kind, buffer in (("parameter", group.hfsdp_helper_wbuf or group.model_weight_buffer),
                                 ("gradient", group.hfsdp_helper_gbuf or group.main_grad_buffer)):
                if buffer is not None:
                    held[kind] += buffer.data.numel()
    ddp = chunks[0].ddp_config
    strategy, replicas = ddp.data_parallel_sharding_strategy, ddp.num_distributed_optimizer_instances
    dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    over = f"DP×CP={dp_cp}"
    if replicas > 1:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        across = ("replicated across them" if ddp.outer_dp_sharding_strategy == "no_shard"
                  else "the optimizer state also sharded across them")
        over = (f"each of {replicas} HSDP groups of {dist.get_world_size(group)} DP×CP ranks (this rank's: "
                f"{dist.get_process_group_ranks(group)}), {across}")
    return (f"Megatron-FSDP {strategy} (ZeRO-{ZERO_LEVEL[strategy]}) over {over}: "
            f"this rank holds {held['parameter']:,} parameter and {held['gradient']:,} gradient elements of its "
            f"tensor-parallel part's {whole:,}")


def _coordinates() -> dict[str, Any]:
    ps = parallel_state
    return {
        "rank": dist.get_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "groups": {
            "TP": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
            "CP": dist.get_process_group_ranks(ps.get_context_parallel_group()),
            "DP": dist.get_process_group_ranks(ps.get_data_parallel_group()),
            "PP": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        },
    }


def _local_experts(chunks: list[GPTModel]) -> Optional[list[int]]:
    """The global indices of the experts this rank holds, read from its first MoE layer; None without one."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            if hasattr(layer.mlp, "local_expert_indices"):
                return list(layer.mlp.local_expert_indices)
    return None


def describe_layout(chunks: list[GPTModel], layer_numbers: list[list[int]]) -> str:
    """Which global ranks form each TP/CP/DP/PP group (and, for an MoE model, each expert group, with the experts
    each rank holds) and which decoder layers (`layer_numbers`: this rank's, per chunk) each pipeline stage holds.

    Collective: every rank must call it; the text is meant for rank 0 to print.
    """
    me = _coordinates()
    me["layers"] = layer_numbers
    me["experts"] = _local_experts(chunks)
    ps = parallel_state
    if me["experts"] is not None or ps.get_expert_model_parallel_world_size() > 1:
        me["groups"].update({
            "EP": dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
            "ETP": dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group()),
            "expert-DP": dist.get_process_group_ranks(ps.get_expert_data_parallel_group()),
        })
    everyone: list[dict[str, Any]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, me)
    world = len(everyone)
    tp, cp, pp = (ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                  ps.get_pipeline_model_parallel_world_size())
    lines = [f"layout: world={world} = TP{tp} × CP{cp} × DP{world // (tp * cp * pp)} × PP{pp}"
             + (f" (VPP{len(chunks)})" if len(chunks) > 1 else "")]
    if "EP" in me["groups"]:
        ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        lines.append(f"  expert layers: world={world} = ETP{etp} × EP{ep} × "
                     f"expert-DP{expert_data_parallel_size(world, pp, ep, etp)} "
                     f"× PP{pp}")
    for name in me["groups"]:
        groups = sorted({tuple(r["groups"][name]) for r in everyone})
        lines.append(f"  {name} groups: " + " ".join(str(list(g)) for g in groups))
    held = {}
    for r in everyone:
        if r["experts"]:
            held.setdefault(tuple(r["experts"]), []).append(r["rank"])
    if held:
        lines.append(f"  experts per rank: {len(next(iter(held)))} — " + "; ".join(
            f"experts {list(experts)} on ranks {ranks}" for experts, ranks in sorted(held.items())))
    for stage in range(pp):
        rank = next(r for r in everyone if r["pp"] == stage)
        spans = []
        for vp, numbers in enumerate(rank["layers"]):
            span = f"{numbers[0]}-{numbers[-1]}" if numbers else "none"
            spans.append(f"chunk {vp}: layers {span}" if len(chunks) > 1 else f"layers {span}")
        holders = [r["rank"] for r in everyone if r["pp"] == stage]
        lines.append(f"  PP stage {stage} (ranks {holders}): " + "; ".join(spans)
                     + (" + embedding" if stage == 0 else "") + (" + output layer/loss" if stage == pp - 1 else ""))
    return "\n".join(lines)
