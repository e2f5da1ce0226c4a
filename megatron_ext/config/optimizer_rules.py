"""The optimizer's rules: megatron-core's Muon (its emerging-optimizer path and layer-wise distributed optimizer,
0.19.2) and QK-clip against the layout and precision, and optimizer CPU offload (megatron-core's
HybridDeviceOptimizer). Each broken rule is one ConfigError naming the key and what to do, before any process
starts."""

from __future__ import annotations

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.errors import require


def validate_optimizer(cfg: RecipeConfig) -> None:
    """optimizer.name=muon, model.qk_clip and optimizer.optimizer_cpu_offload against the rest of the recipe."""
    _validate_muon(cfg)
    _validate_offload(cfg)


def _validate_muon(cfg: RecipeConfig) -> None:
    m, o, p, t, c = cfg.model, cfg.optimizer, cfg.parallel, cfg.train, cfg.checkpoint
    if m.qk_clip:
        require(o.name == "muon", "model.qk_clip", True,
                "is MuonClip's, and needs optimizer.name=muon: megatron-core 0.19.2 clips the weights through Muon's "
                "optimizers (under Adam's distributed optimizer its fp32 master shards would undo the clip)")
        require(p.context_parallel_size == 1 or m.attention_backend == "te", "model.qk_clip", True,
                "records each head's largest logit in one piece of the sequence: with parallel.context_parallel_size > "
                "1 only TransformerEngine's attention (TE 2.9+) records it — set model.attention_backend=te or CP 1")
    if o.name != "muon":
        return
    for ok, key, value, why in [
        (not p.use_megatron_fsdp, "parallel.use_megatron_fsdp", True,
         "Megatron-FSDP shards parameters by bytes; Muon orthogonalizes whole matrices: megatron-core 0.19.2 runs Muon "
         "with its layer-wise distributed optimizer (parallel.use_distributed_optimizer=true) or none"),
        (not o.optimizer_cpu_offload, "optimizer.optimizer_cpu_offload", True,
         "megatron-core's optimizer offload steps Adam on the host; it has no Muon: set it false"),
        (t.precision != "fp16", "train.precision", "fp16",
         "megatron-core 0.19.2 refuses Muon with fp16 loss scaling: use bf16"),
        # its layer-wise optimizer wraps the Muon and Adam it chains in megatron-core's bf16 optimizer only: in fp32
        # they stay bare torch optimizers and the chain's config check fails at build (optimizer/__init__.py:982)
        (t.precision == "bf16" or not p.use_distributed_optimizer, "train.precision", t.precision,
         "Muon's layer-wise distributed optimizer runs in bf16 in megatron-core 0.19.2: set train.precision=bf16, or "
         "parallel.use_distributed_optimizer=false (every DP rank then keeps the whole Muon state)"),
        (not c.optimizer_format.endswith("_mem_efficient"), "checkpoint.optimizer_format", c.optimizer_format,
         "gathers over gloo groups megatron-core's Muon path does not build: use fully_reshardable (or auto)"),
    ]:
        require(ok, key, value, why)


def _validate_offload(cfg: RecipeConfig) -> None:
    """What optimizer.optimizer_cpu_offload runs with: megatron-core's HybridDeviceOptimizer inside the distributed
    optimizer, as verified here (docs/memory.md)."""
    o, p, t = cfg.optimizer, cfg.parallel, cfg.train
    if not o.optimizer_cpu_offload:
        return
    for ok, key, value, why in [
        (p.use_distributed_optimizer, "parallel.use_distributed_optimizer", False,
         "megatron-core offloads the distributed optimizer's state shards: set it true"),
        (not p.use_megatron_fsdp, "parallel.use_megatron_fsdp", True,
         "offload under Megatron-FSDP is not verified here: use ZeRO-1 (parallel.use_megatron_fsdp=false)"),
        (t.precision == "bf16", "train.precision", t.precision,
         "offload needs train.precision=bf16: megatron-core hands the host optimizer bf16 weight shards (fp32 ones are "
         "views torch refuses to optimize; fp16 loss scaling under offload is not verified)"),
        (t.fp8 is None, "train.fp8", t.fp8, "offload with FP8 is not verified here"),
        (t.fp4 is None, "train.fp4", t.fp4, "offload with FP4 is not verified here"),
    ]:
        require(ok, key, value, why)
