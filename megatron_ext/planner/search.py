"""The search: every layout the recipe accepts for a world size, estimated and ranked; the best one as config
values; this machine's GPU."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Iterator, Optional

from megatron_ext.config.model_rules import megatron_fsdp_refusal, needs_sequence_parallel
from megatron_ext.config.schema import RecipeConfig, ShardingStrategy, model_expert_tensor_parallel_size
from megatron_ext.config.validate import validate_layout_rules
from megatron_ext.errors import ConfigError
from megatron_ext.hardware import GPUS, GPUSpec
from megatron_ext.planner.estimate import Estimate, estimate
from megatron_ext.planner.layout import GIB, Layout, model_vocab_size

OFFLOAD_FRACTIONS = (0.5, 1.0)  # what the search tries when no layout fits without offload
# The shortest of the 2·CP chunks a context-parallel rank's sequence is cut into that the search tries: the time
# model's per-ring-step costs are not calibrated on shorter ones, and each CP size the model allows multiplies the
# layouts to estimate (a 4,096-token DeepSeek-V3 on 192 GPUs: 36,984 with every CP size, 24,576 up to CP 4).
MIN_CP_CHUNK_TOKENS = 512


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# (distributed optimizer, Megatron-FSDP strategy): DDP, ZeRO-1, ZeRO-2, ZeRO-3
_DATA_PARALLEL_SHARDINGS: tuple[tuple[bool, Optional[ShardingStrategy]], ...] = (
    (False, None), (True, None), (True, "optim_grads"), (True, "optim_grads_params"))


def _hsdp_replicas(sharding: Optional[ShardingStrategy], tp: int, cp: int, dp: int, gpus_per_node: int
                   ) -> list[int]:
    """HSDP group counts worth trying: 1, and for Megatron-FSDP over more than one node, one group per node (the
    sharding's gathers on NVLink, one all-reduce across nodes per step)."""
    nodes, spare = divmod(tp * cp * dp, gpus_per_node)
    return [1, nodes] if sharding and not spare and nodes > 1 and (dp * cp) % nodes == 0 else [1]


def _expert_layouts(cfg: RecipeConfig, stage_ranks: int, tp: int) -> list[tuple[int, Optional[int]]]:
    """(EP, ETP) pairs worth trying for an MoE model on `stage_ranks` ranks per pipeline stage: every EP dividing
    the experts and the stage, each expert split over TP (ETP None) or whole (ETP1); (1, None) for a dense model."""
    experts = cfg.model.num_moe_experts
    if experts is None:
        return [(1, None)]
    implied = model_expert_tensor_parallel_size(cfg.model)
    etps: list[Optional[int]] = [implied] if implied else [None, 1] if tp > 1 else [None]
    return [(ep, etp) for ep in _divisors(math.gcd(experts, stage_ranks)) for etp in etps]


def pipeline_splits(layers: int, pp: int) -> list[tuple[Optional[int], Optional[int]]]:
    """(first, last) stage layer counts the search tries at `pp` stages: the even split where the layers divide,
    else near-even ones — the middle stages k = ⌊layers/pp⌋ or ⌈layers/pp⌉ each, the rest halved between the first
    and last stage with the last (which also runs the output layer and loss) never holding more, at most k + 1
    (126 layers at PP 8: 15 + 6 × 16 + 15). At PP 2 only the last is set (megatron-core refuses both there)."""
    if layers % pp == 0:
        return [(None, None)]
    splits: list[tuple[Optional[int], Optional[int]]] = []
    for k in sorted({layers // pp, -(-layers // pp)}):
        rest = layers - (pp - 2) * k
        last = rest // 2
        first = rest - last
        if 1 <= last <= first <= k + 1:
            splits.append((None, last) if pp == 2 else (first, last))
    return list(dict.fromkeys(splits))


def accepts_layout(cfg: RecipeConfig, world_size: int, gpu: GPUSpec) -> None:
    """`cfg`'s layout and switches as the recipe checks them before launch on `world_size` GPUs of type `gpu`
    (TransformerEngine assumed present); ConfigError with the refusal's line otherwise."""
    validate_layout_rules(cfg, world_size, te_available=True, compute_capability=gpu.compute_capability)


def candidate_layouts(cfg: RecipeConfig, world_size: int, gpus_per_node: int,
                      micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8), gpu: GPUSpec = GPUS["h100-80gb"]
                      ) -> Iterator[Layout]:
    """Every layout `validate_layout_rules` accepts, with TP inside one node and the pipeline split evenly or near-evenly
    (:func:`pipeline_splits`; virtual stages only with an even split); with the
    distributed optimizer, also ZeRO-2 and ZeRO-3 through Megatron-FSDP (PP=1); for an MoE model, every EP and
    expert TP too. Without optimizer offload, whatever `cfg` sets: like recompute, it is the search's to choose
    (:func:`plan`)."""
    gpn = min(gpus_per_node, world_size)
    layers = cfg.model.num_layers
    # ZeRO-2/3 only where the model may use Megatron-FSDP at all (else every such layout would be refused below)
    shardings = [choice for choice in _DATA_PARALLEL_SHARDINGS
                 if choice[1] is None or megatron_fsdp_refusal(cfg.model) is None]
    sequence_parallel = [True] if needs_sequence_parallel(cfg.model) else [False, True]  # under TP
    for tp in _divisors(gpn):
        for pp in _divisors(world_size // tp):
            splits: list[tuple[Optional[int], tuple[Optional[int], Optional[int]]]] = [
                (None, split) for split in pipeline_splits(layers, pp)]
            if pp > 1 and layers % pp == 0:
                splits += [(v, (None, None)) for v in _divisors(layers // pp) if v > 1]
            for cp in [c for c in _divisors(world_size // (tp * pp)) if c == 1 or
                       cfg.model.seq_length // (2 * c) >= MIN_CP_CHUNK_TOKENS]:
                dp = world_size // (tp * pp * cp)
                choices = itertools.product(splits, sequence_parallel if tp > 1 else [False], shardings,
                                            (None, "selective", "full"), micro_batch_sizes,
                                            _expert_layouts(cfg, world_size // pp, tp))
                for (vpp, (first, last)), sp, (distopt, sharding), recompute, mbs, (ep, etp) in choices:
                    for replicas in _hsdp_replicas(sharding, tp, cp, dp, gpn):
                        layout = Layout(tp, pp, vpp, cp, dp, sp, distopt, recompute, mbs, sharding, replicas,
                                        ep=ep, etp=etp, first_stage_layers=first, last_stage_layers=last)
                        try:
                            accepts_layout(layout.apply(cfg), world_size, gpu)
                        except ConfigError:
                            continue
                        yield layout


def _with_offload(cfg: RecipeConfig, world_size: int, layouts: list[Layout], gpu: GPUSpec) -> Iterator[Layout]:
    """The distributed-optimizer layouts among `layouts` again with OFFLOAD_FRACTIONS of the optimizer state in host
    memory, where `validate_layout_rules` accepts it (bf16, no Megatron-FSDP)."""
    for layout in layouts:
        if layout.distopt and not layout.sharding:
            for fraction in OFFLOAD_FRACTIONS:
                offloaded = dataclasses.replace(layout, offload=fraction)
                try:
                    accepts_layout(offloaded.apply(cfg), world_size, gpu)
                except ConfigError:
                    continue
                yield offloaded


def plan(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: str | GPUSpec,
         mfu: Optional[float] = None, grad_reduce_in_fp32: bool = True) -> list[Estimate]:
    """Every valid layout: those that fit first, DDP/ZeRO-1 before ZeRO-2/3 before optimizer offload (tried only
    when nothing fits without it), fastest first (then smallest memory)."""
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    vocab = model_vocab_size(cfg)

    def estimates_of(layouts: Iterator[Layout]) -> list[Estimate]:
        return [estimate(layout.apply(cfg), world_size, gpus_per_node, spec, vocab, mfu, grad_reduce_in_fp32)
                for layout in layouts]

    estimates = estimates_of(candidate_layouts(cfg, world_size, gpus_per_node, gpu=spec))
    if not any(e.fits for e in estimates):  # the guide's last resort
        estimates += estimates_of(_with_offload(cfg, world_size, [e.layout for e in estimates], spec))
    by_layout = {e.layout: e for e in estimates}
    for e in estimates:
        if e.layout.sharding:
            counterpart = by_layout.get(dataclasses.replace(e.layout, sharding=None, replicas=1))
            e.without_sharding = counterpart.memory if counterpart else None
        if e.layout.offload:
            counterpart = by_layout.get(dataclasses.replace(e.layout, offload=0.0))
            e.without_offload = counterpart.memory if counterpart else None
    # The guide's decision tree: ZeRO-2/3 when nothing lighter fits, offload last. Megatron-FSDP's and offload's time
    # terms are uncalibrated and cost bandwidth ZeRO-1 does not spend, so a fitting DDP/ZeRO-1 layout ranks first.
    return sorted(estimates, key=lambda e: (not e.fits, e.layout.offload > 0, e.layout.sharding is not None,
                                            e.time["step"], e.memory["total"]))


def detect_gpu() -> str:
    """This machine's GPU as a GPUS key; a CPU rehearsal plans for an H100 cluster."""
    import torch

    if not torch.cuda.is_available():
        return "h100-80gb"
    name = torch.cuda.get_device_name()
    memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    for key, spec in GPUS.items():
        if spec.name.split()[0] in name and abs(spec.memory_gib - memory_gib) < 8:
            return key
    raise ConfigError(f"parallel.auto: no planner entry for {name} ({memory_gib:.0f} GiB); "
                      f"set parallel.auto_gpu to one of {', '.join(GPUS)}")


def planner_gpu(cfg: RecipeConfig) -> Optional[str]:
    """The planner's entry for this machine's GPU (parallel.auto_gpu, else detected; CPU rehearsal plans for an
    H100); None for a GPU the planner has no entry for (its estimates are then left out)."""
    try:
        return cfg.parallel.auto_gpu or detect_gpu()
    except ConfigError:
        return None


def best_layout(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: str) -> dict[str, Any]:
    """The fastest layout that fits, as ``parallel.*`` / ``train.*`` values to set on the config."""
    ranked = plan(cfg, world_size, gpus_per_node, gpu)
    if not ranked or not ranked[0].fits:
        smallest = min(ranked, key=lambda e: e.memory["total"], default=None)
        need = f"; the smallest needs {smallest.memory['total'] / GIB:.1f} GiB ({smallest.layout.label()})" \
            if smallest else ""
        raise ConfigError(f"no valid layout of {cfg.recipe.name} fits on {world_size}× {gpu}{need}")
    return ranked[0].overrides
