"""Recipe configs for real model shapes: parameter counts match the published figures, layouts are the planner's best for their GPUs."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_ext.config.schema import data_parallel_size, load_config
from megatron_ext.config.shape import ModelShape, padded_vocab_size
from megatron_ext.config.validate import validate_layout
from tests.launch import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
REAL = [p for p in CONFIGS if not p.name.startswith("tiny")]


def test_there_are_real_model_recipes():
    assert {p.name for p in REAL} >= {"llama3_2_1b_1gpu_bf16.yaml", "llama3_8b_8gpu_bf16.yaml",
                                      "llama3_70b_64gpu_bf16.yaml", "llama3_1_405b_40gpu_bf16.yaml",
                                      "mixtral_8x7b_64gpu_bf16.yaml", "qwen3_30b_a3b_16gpu_bf16.yaml",
                                      "deepseek_v3_671b_192gpu_fp8.yaml", "kimi_k2_1t_192gpu_bf16.yaml"}


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.stem)
def test_parameter_count_matches_published(path):
    """Published counts are the main model's: DeepSeek-V3's 671 B leaves its MTP module (14 B) out."""
    cfg = load_config(path)
    main_model = replace(ModelShape.of(cfg.model), mtp_num_layers=0)
    assert main_model.num_parameters(cfg.model.vocab_size) == cfg.recipe.published_params


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_layout_is_valid_for_its_gpu_count(path):
    cfg = load_config(path)
    fp8 = cfg.train.fp8 is not None  # validated as on the H100s with TransformerEngine it is written for
    validate_layout(cfg, world_size=cfg.recipe.gpus, te_available=fp8, compute_capability=(9, 0) if fp8 else None)
    assert data_parallel_size(cfg, cfg.recipe.gpus) >= 1


@pytest.mark.parametrize("name, gpus", [("llama3_8b_8gpu_bf16.yaml", 8), ("llama3_70b_64gpu_bf16.yaml", 64),
                                        ("llama3_1_405b_40gpu_bf16.yaml", 40), ("mixtral_8x7b_64gpu_bf16.yaml", 64),
                                        ("qwen3_30b_a3b_16gpu_bf16.yaml", 16),
                                        ("deepseek_v3_671b_192gpu_fp8.yaml", 192),
                                        ("kimi_k2_1t_192gpu_bf16.yaml", 192)])
def test_multi_gpu_recipes_ship_the_planners_best_layout_for_their_gpu_count(name, gpus):
    from megatron_ext.planner import best_layout

    cfg = load_config(ROOT / "configs" / name)
    best = [f"{k}={'null' if v is None else v}" for k, v in best_layout(cfg, gpus, 8, "h100-80gb").items()]
    assert cfg.recipe.gpus == gpus and load_config(ROOT / "configs" / name, best) == cfg


def test_llama3_vocab_pads_to_a_tp_multiple():
    assert padded_vocab_size(128256, 128, 1) == 128256  # 128 × 1002
    assert padded_vocab_size(128256, 128, 8) == 129024  # next multiple of 128 × 8
    assert padded_vocab_size(32001, 128, 2) == 32256


def test_405b_recipe_runs_on_the_fewest_gpus_that_fit_with_uneven_pipeline_stages():
    """Its GPU count is the smallest (in whole nodes) the planner finds a layout for, with the optimizer state in
    host memory, which the search tries only when nothing fits without it, and 126 layers split 11 + 8 × 13 + 11
    over PP10; 112 GPUs fit without offload (PP14, even); on 128 a deeper uneven pipeline (3 + 30 × 4 + 3) fits
    without offload or ZeRO-3."""
    from megatron_ext.planner import plan

    cfg = load_config(ROOT / "configs" / "llama3_1_405b_40gpu_bf16.yaml")
    assert cfg.recipe.gpus == 40 and cfg.optimizer.optimizer_cpu_offload
    for fewer in range(8, 40, 8):
        assert not any(e.fits for e in plan(cfg, fewer, 8, "h100-80gb")), fewer
    best = plan(cfg, 40, 8, "h100-80gb")[0]
    assert best.fits and best.layout.offload == 1.0
    assert (best.layout.pp, best.layout.first_stage_layers, best.layout.last_stage_layers) == (10, 11, 11)
    assert best.without_offload is not None and best.without_offload["total"] > 2 * best.memory["total"]
    best = plan(cfg, 112, 8, "h100-80gb")[0]
    assert best.fits and not best.layout.offload and best.layout.pp == 14
    best = plan(cfg, 128, 8, "h100-80gb")[0]
    assert best.fits and not best.layout.offload and best.layout.sharding is None
    assert (best.layout.pp, best.layout.first_stage_layers, best.layout.last_stage_layers) == (32, 3, 3)


@pytest.mark.parametrize("path", [p for p in CONFIGS if " s/step, " in p.read_text()], ids=lambda p: p.stem)
def test_the_step_time_and_memory_a_recipe_states_are_the_planners(path):
    """A recipe's header states the planner's estimate for its own layout on H100 80GB ("N s/step, M of 80 GiB"),
    to the digits it gives: when the planner changes, this names the comments to regenerate."""
    from megatron_ext.hardware import GPUS
    from megatron_ext.planner import GIB, estimate, model_vocab_size

    stated = re.search(r"([\d.]+) s/step, ([\d.]+) of 80 GiB", path.read_text())
    cfg = load_config(path)
    e = estimate(cfg, cfg.recipe.gpus, 8, GPUS["h100-80gb"], model_vocab_size(cfg))
    for text, value in ((stated[1], e.time["step"]), (stated[2], e.memory["total"] / GIB)):
        digits = len(text.split(".")[1]) if "." in text else 0
        assert float(text) == round(value, digits), (path.name, text, value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_recipe_keeps_one_run_directory(path):
    """Checkpoints, TensorBoard events, rank logs, profiles and W&B files of one run sit in one directory."""
    from megatron_ext.config.schema import log_dir, profile_dir

    cfg = load_config(path)
    run = {Path(cfg.checkpoint.save).parent, Path(cfg.logging.tensorboard_dir).parent, Path(log_dir(cfg)).parent,
           profile_dir(cfg).parent}
    assert len(run) == 1, run
