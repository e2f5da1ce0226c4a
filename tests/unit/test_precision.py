"""train.fp8's recipes, train.fp4 and train.fp8_param_gather: each reaches megatron-core's TransformerConfig (and the
DDP config) as asked, and runs only on the GPUs TransformerEngine runs it on, checked against the GPU's compute
capability before launch in one line."""

from __future__ import annotations

import pytest

from megatron_ext.config.precision import LOW_PRECISION_GPUS
from megatron_ext.config.schema import load_config
from megatron_ext.config.validate import validate_layout
from megatron_ext.distributed.parallel import ddp_config
from megatron_ext.errors import ConfigError
from megatron_ext.model.llama import transformer_config
from tests.launch import TINY

BF16 = "train.precision=bf16"
AMPERE, ADA, HOPPER, BLACKWELL, RTX_BLACKWELL = (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)


def tiny(*overrides: str):
    return load_config(TINY, [BF16, *overrides])


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_every_fp8_recipe_reaches_megatron_core_in_tes_hybrid_format(recipe):
    config = transformer_config(tiny(f"train.fp8={recipe}"), on_gpu=False, use_te=True)
    assert (config.fp8, config.fp8_recipe, config.fp8_param, config.fp4) == ("hybrid", recipe, False, None)


def test_fp4_reaches_megatron_core_as_nvfp4_e2m1():
    config = transformer_config(tiny("train.fp4=nvfp4"), on_gpu=False, use_te=True)
    assert (config.fp4, config.fp4_recipe, config.fp8) == ("e2m1", "nvfp4", None)


def test_fp8_parameters_are_kept_by_the_model_and_gathered_by_the_distributed_optimizer():
    cfg = tiny("train.fp8=blockwise", "train.fp8_param_gather=true")
    validate_layout(cfg, 4, te_available=True, compute_capability=HOPPER)
    assert transformer_config(cfg, on_gpu=False, use_te=True).fp8_param is True
    assert ddp_config(cfg).fp8_param_gather is True and ddp_config(tiny()).fp8_param_gather is False


@pytest.mark.parametrize("recipe, runs_on, refused_on", [
    ("delayed", [ADA, HOPPER, BLACKWELL, RTX_BLACKWELL], [AMPERE, None]),
    ("tensorwise", [ADA, HOPPER, BLACKWELL], [AMPERE, None]),
    ("blockwise", [HOPPER, BLACKWELL], [ADA, AMPERE, None]),
    ("mxfp8", [BLACKWELL, (10, 3), (11, 0)], [HOPPER, RTX_BLACKWELL, None]),
    ("nvfp4", [BLACKWELL, RTX_BLACKWELL], [HOPPER, ADA, None]),
])
def test_each_recipe_runs_on_the_gpus_transformer_engine_runs_it_on(recipe, runs_on, refused_on):
    key = "train.fp4" if recipe == "nvfp4" else "train.fp8"
    cfg = tiny(f"{key}={recipe}")
    for capability in runs_on:
        validate_layout(cfg, 4, te_available=True, compute_capability=capability)
    for capability in refused_on:
        here = "no GPU here" if capability is None else f"this GPU's is {capability[0]}.{capability[1]}"
        with pytest.raises(ConfigError, match=rf"^{key}='{recipe}' is invalid: TransformerEngine runs it on compute "
                                              rf"capability {LOW_PRECISION_GPUS[recipe].lowest[0]}\.\d.*, and {here}"):
            validate_layout(cfg, 4, te_available=True, compute_capability=capability)


def test_a_refused_recipe_names_the_ones_this_gpu_runs():
    with pytest.raises(ConfigError, match=r"train.fp8='mxfp8' is invalid: TransformerEngine runs it on compute "
                                          r"capability 10.0 to 11.x: Blackwell data-center GPUs.*, and this GPU's is "
                                          r"9.0 — use train.fp8=delayed or tensorwise or blockwise on this GPU"):
        validate_layout(tiny("train.fp8=mxfp8"), 4, te_available=True, compute_capability=HOPPER)
    with pytest.raises(ConfigError, match=r"train.fp8='delayed' is invalid: .* this GPU's is 8.0 — set "
                                          r"train.fp8=null on this machine$"):
        validate_layout(tiny("train.fp8=delayed"), 4, te_available=True, compute_capability=AMPERE)


@pytest.mark.parametrize("overrides, fragment", [
    (["train.fp4=nvfp4", "train.fp8=mxfp8"], r"train.fp4='nvfp4' is invalid: cannot run with train.fp8 "
     r"\(megatron-core runs one low-precision recipe at a time\)"),
    (["train.fp4=nvfp4", "train.precision=fp32"], r"train.precision='fp32' is invalid: FP4 training needs "
     r"train.precision=bf16"),
    (["train.fp4=nvfp4", "model.attention_backend=local"], r"train.fp4='nvfp4' is invalid: FP4 runs only in "
     r"TransformerEngine's layers"),
    (["train.fp8_param_gather=true"], r"train.fp8_param_gather=True is invalid: keeps the parameters in FP8: set "
     r"train.fp8 too"),
    (["train.fp8_param_gather=true", "train.fp8=mxfp8", "parallel.use_distributed_optimizer=false"],
     r"parallel.use_distributed_optimizer=False is invalid: train.fp8_param_gather all-gathers the FP8 parameters"),
    (["train.fp8_param_gather=true", "train.fp8=mxfp8", "parallel.use_megatron_fsdp=true",
      "parallel.pipeline_model_parallel_size=1", "checkpoint.save=null"],
     r"parallel.use_megatron_fsdp=True is invalid: FP8 parameters under Megatron-FSDP are not verified"),
    (["train.fp4=nvfp4", "optimizer.optimizer_cpu_offload=true"], r"train.fp4='nvfp4' is invalid: offload with FP4"),
])
def test_what_megatron_core_or_this_recipe_refuses_is_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate_layout(tiny(*overrides), 4, te_available=True, compute_capability=BLACKWELL)


def test_fp4_needs_transformer_engine():
    with pytest.raises(ConfigError, match=r"train.fp4='nvfp4' is invalid: FP4 runs through TransformerEngine, which "
                                          r"is not importable here"):
        validate_layout(tiny("train.fp4=nvfp4"), 4, te_available=False, compute_capability=BLACKWELL)
