"""Training precision against the GPU it runs on: train.precision, TransformerEngine's FP8 and FP4 recipes
(train.fp8, train.fp4) and FP8 parameters (train.fp8_param_gather). Which GPUs each recipe runs on is
:data:`LOW_PRECISION_GPUS`, by CUDA compute capability (None: no GPU, a CPU rehearsal); each refusal is one line naming
the key, the value, this GPU's capability and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, get_args

from megatron_ext.config.schema import FP8Recipe, RecipeConfig
from megatron_ext.errors import require

Capability = tuple[int, int]  # CUDA compute capability (major, minor): torch.cuda.get_device_capability()


@dataclass(frozen=True)
class GPURange:
    """The compute capabilities a recipe's kernels run on: from `lowest` up to, not including, `below`."""

    lowest: Capability
    below: Optional[Capability]  # None: every newer GPU
    gpus: str  # the architectures, as a reader knows them

    def holds(self, capability: Optional[Capability]) -> bool:
        return capability is not None and self.lowest <= capability and (self.below is None or capability < self.below)

    def __str__(self) -> str:
        lowest = f"{self.lowest[0]}.{self.lowest[1]}"
        span = f"{lowest}+" if self.below is None else f"{lowest} to {self.below[0] - 1}.x"
        return f"compute capability {span}: {self.gpus}"


# TransformerEngine's own checks (2.17, transformer_engine/pytorch/quantization.py: check_fp8_support,
# check_fp8_block_scaling_support — also CUDA 12.9+, check_mxfp8_support, check_nvfp4_support)
LOW_PRECISION_GPUS: dict[str, GPURange] = {
    "delayed": GPURange((8, 9), None, "Ada, Hopper, Blackwell"),
    "tensorwise": GPURange((8, 9), None, "Ada, Hopper, Blackwell"),
    "blockwise": GPURange((9, 0), None, "Hopper, Blackwell"),
    "mxfp8": GPURange((10, 0), (12, 0), "Blackwell data-center GPUs: B200, GB200, B300, GB300"),
    "nvfp4": GPURange((10, 0), None, "Blackwell"),
}


def shown_capability(capability: Optional[Capability]) -> str:
    return "no GPU here (CPU rehearsal)" if capability is None else \
        f"this GPU's is {capability[0]}.{capability[1]}"


def _require_gpu(key: str, recipe: str, capability: Optional[Capability]) -> None:
    """`recipe` (train.fp8's or train.fp4's value) runs on this GPU; else one line with the FP8 recipes that do."""
    gpus = LOW_PRECISION_GPUS[recipe]
    if gpus.holds(capability):  # (the planner validates thousands of layouts: the message only when refused)
        return
    here = [r for r in get_args(FP8Recipe) if LOW_PRECISION_GPUS[r].holds(capability)]
    instead = f"use train.fp8={' or '.join(here)} on this GPU, a GPU of that capability, or set {key}=null" if here \
        else f"set {key}=null on this machine"
    require(False, key, recipe, f"TransformerEngine runs it on {gpus}, and {shown_capability(capability)} — {instead}")


def _require_te_layers(cfg: RecipeConfig, key: str, value: str, te_available: bool) -> None:
    """A TransformerEngine recipe: TE imports and its layers are built."""
    if te_available and cfg.model.attention_backend != "local":
        return
    what = "FP8" if key == "train.fp8" else "FP4"
    require(te_available, key, value, f"{what} runs through TransformerEngine, which is not importable here (use the NGC "
            f"container, see docs/docker.md) — or set {key}=null")
    # Local layers ignore TE's autocast: the run would train in BF16 without a word.
    require(cfg.model.attention_backend != "local", key, value, f"{what} runs only in TransformerEngine's layers, and "
            "model.attention_backend=local (also what train.compile needs) builds megatron-core's local layers — set "
            f"model.attention_backend=auto and train.compile=false, or {key}=null")


def validate_precision(cfg: RecipeConfig, te_available: bool, compute_capability: Optional[Capability]) -> None:
    """train.precision, fp8, fp4 and fp8_param_gather against the layer spec and the GPU (`compute_capability`)."""
    t, p = cfg.train, cfg.parallel
    require(t.fp8 is None or t.fp4 is None, "train.fp4", t.fp4, "cannot run with train.fp8 (megatron-core runs one "
            "low-precision recipe at a time): set one of them null")
    for key, recipe in (("train.fp8", t.fp8), ("train.fp4", t.fp4)):
        if recipe is None:
            continue
        _require_te_layers(cfg, key, recipe, te_available)
        _require_gpu(key, recipe, compute_capability)
        require(t.precision == "bf16", "train.precision", t.precision, f"{key.split('.')[1].upper()} training needs "
                "train.precision=bf16")
    if t.fp8_param_gather:
        require(t.fp8 is not None, "train.fp8_param_gather", True, "keeps the parameters in FP8: set train.fp8 too "
                "(megatron-core's rule)")
        require(p.use_distributed_optimizer, "parallel.use_distributed_optimizer", False,
                "train.fp8_param_gather all-gathers the FP8 parameters from the distributed optimizer's fp32 shards "
                "(megatron-core's rule): set it true")
        require(not p.use_megatron_fsdp, "parallel.use_megatron_fsdp", True, "FP8 parameters under Megatron-FSDP are "
                "not verified here: use the distributed optimizer (ZeRO-1) with train.fp8_param_gather")
    if t.precision == "fp16":
        require(t.initial_loss_scale >= t.min_loss_scale, "train.initial_loss_scale", t.initial_loss_scale,
                f"must be >= train.min_loss_scale ({t.min_loss_scale:g})")
