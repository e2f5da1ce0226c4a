"""Config loading and validation: every bad layout is one clear error before any process starts."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
from types import SimpleNamespace
from typing import get_args

import pytest

from megatron_ext.config.kernels import resolve_kernel_options
from megatron_ext.config.schema import LRDecayStyle, RecipeConfig, config_keys, keys_table, load_config, parse_blend
from megatron_ext.config.validate import trained_world, validate, validate_layout
from megatron_ext.data.checks import validate_data
from megatron_ext.errors import ConfigError
from tests.launch import ROOT, TINY

ZERO3 = ["parallel.use_megatron_fsdp=true", "parallel.pipeline_model_parallel_size=1", "checkpoint.save=null"]


def tiny(*overrides: str):
    return load_config(TINY, list(overrides))


def test_tiny_config_is_valid_for_four_processes():
    cfg = tiny()
    validate(cfg, world_size=4)
    validate_data(cfg)
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.pipeline_model_parallel_size == 2


def test_overrides_are_typed():
    cfg = tiny("train.train_iters=7", "optimizer.lr=1e-3", "parallel.sequence_parallel=false")
    assert cfg.train.train_iters == 7 and cfg.optimizer.lr == 1e-3 and cfg.parallel.sequence_parallel is False


@pytest.mark.parametrize(
    "overrides, world, fragment",
    [
        ([], 3, "world size (processes started)=3 is invalid: must be a multiple of"),
        (["model.num_layers=3"], 4, "model.num_layers=3"),
        (["model.num_layers=6", "parallel.virtual_pipeline_model_parallel_size=2"], 4,
         "model.num_layers=6 is invalid: must be divisible by pipeline_model_parallel_size×virtual"),
        (["model.hidden_size=240", "model.num_attention_heads=6", "model.num_query_groups=3"], 4,
         "model.num_query_groups=3 is invalid: must be divisible by parallel.tensor_model_parallel_size=2"),
        (["model.num_attention_heads=5", "model.num_query_groups=null"], 4, "model.hidden_size=256"),
        (["model.num_query_groups=3"], 4, "must divide model.num_attention_heads=8"),
        (["train.global_batch_size=6"], 8, "multiple of micro_batch_size×DP = 4×2 = 8"),
        (["parallel.tensor_model_parallel_size=1"], 2, "parallel.sequence_parallel=True is invalid"),
        (["parallel.context_parallel_size=2", "model.seq_length=250", "parallel.sequence_parallel=false",
          "parallel.tensor_model_parallel_size=1"], 4, "divisible by 2×context_parallel_size=4"),
        (["model.seq_length=254", "parallel.tensor_model_parallel_size=4", "model.num_query_groups=4",
          "parallel.pipeline_model_parallel_size=1"], 4, "seq_length/CP must be divisible by TP=4"),
        (["parallel.num_layers_in_first_pipeline_stage=1", "parallel.num_layers_in_last_pipeline_stage=1"], 4,
         "set only one of num_layers_in_first/last_pipeline_stage"),
        (["train.precision=fp64"], 4,
         "train.precision: Invalid value 'fp64', expected one of ['fp32', 'bf16', 'fp16']"),
        (["optimizer.min_lr=1.0"], 4, "optimizer.min_lr=1.0"),
        (["model.attention_backend=te"], 4, "TransformerEngine is not importable"),
        (["train.micro_batch_size=0"], 4, "train.micro_batch_size=0 is invalid: must be >= 1"),
        (["train.fp8=delayed", "train.precision=bf16"], 4, "FP8 runs through TransformerEngine"),
        (["train.precision=fp16", "train.initial_loss_scale=0.5"], 4,
         "train.initial_loss_scale=0.5 is invalid: must be >= train.min_loss_scale (1)"),
        (["train.precision=fp16", "train.hysteresis=0"], 4, "train.hysteresis=0 is invalid: must be >= 1"),
        # Megatron-FSDP (TP2 × PP2 recipe made TP2 × DP2 unless a case says otherwise)
        ([*ZERO3, "parallel.data_parallel_sharding_strategy=optim"], 4, "ZeRO-1 is the distributed optimizer"),
        ([*ZERO3, "parallel.use_distributed_optimizer=false"], 4, "needs megatron-core's distributed optimizer"),
        (["parallel.use_megatron_fsdp=true", "checkpoint.save=null"], 4, "device mesh over TP×CP×DP only: use it "
         "with PP=1"),
        ([*ZERO3, "parallel.tensor_model_parallel_size=4"], 4, "there is nothing to shard at DP×CP=1"),
        ([*ZERO3, "parallel.overlap_grad_reduce=true"], 4, "Megatron-FSDP overlaps its own gathers"),
        (["parallel.ddp_bucket_size=1000000"], 4, "parallel.ddp_bucket_size=1000000 is invalid: sizes the buckets of "
         "overlapped gradient reduction (one bucket without it): set parallel.overlap_grad_reduce=true"),
        (["parallel.ddp_bucket_size=0", "parallel.overlap_grad_reduce=true"], 4,
         "parallel.ddp_bucket_size=0 is invalid: must be >= 1"),
        ([*ZERO3, "train.precision=fp16"], 4, "fp16 under Megatron-FSDP is not verified"),
        # HSDP (TP2 × DP2 at 4 processes)
        ([*ZERO3, "parallel.num_distributed_optimizer_instances=2"], 4,
         "must divide DP×CP=2 into groups of at least 2 ranks"),
        (["parallel.num_distributed_optimizer_instances=2"], 4, "is HSDP, Megatron-FSDP's"),
        (["parallel.outer_dp_sharding_strategy=optim"], 4, "shards across HSDP replicas: set"),
        ([*ZERO3, "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
          "parallel.num_distributed_optimizer_instances=2", "parallel.outer_dp_sharding_strategy=optim",
          "parallel.data_parallel_sharding_strategy=optim_grads"], 4,
         "needs the parameters sharded inside them (megatron-core's rule)"),

        # optimizer CPU offload (tiny is TP2 × PP2 at 4 processes, fp32 unless a case says otherwise)
        (["optimizer.optimizer_cpu_offload=true"], 4, "offload needs train.precision=bf16"),
        (["optimizer.optimizer_cpu_offload=true", "train.precision=bf16", "parallel.use_distributed_optimizer=false"],
         4, "megatron-core offloads the distributed optimizer's state shards"),
        ([*ZERO3, "optimizer.optimizer_cpu_offload=true", "train.precision=bf16"], 4,
         "offload under Megatron-FSDP is not verified"),
        (["optimizer.optimizer_offload_fraction=0"], 4, "optimizer.optimizer_offload_fraction=0.0 is invalid: must be in"),
        # activation offload
        (["train.offload_modules=[attn_proj]"], 4, "attn_proj needs core_attn too"),
        (["train.offload_modules=[mlp_norm,mlp_norm]"], 4, "names a module twice"),
        (["train.offload_modules=[attn_norm]", "parallel.virtual_pipeline_model_parallel_size=2"], 4,
         "virtual_pipeline_model_parallel_size=2 is invalid: leaves one layer per virtual pipeline stage"),
        (["train.offload_modules=[attn_norm]", "train.recompute_granularity=full"], 4,
         "full recompute keeps only each layer's input: there is nothing left to offload"),
        (["train.offload_modules=[mlp_proj]"], 4, "train.offload_modules[0]: Invalid value 'mlp_proj'"),
        (["train.min_offloaded_tensor_size=-1"], 4, "train.min_offloaded_tensor_size=-1 is invalid"),
        (["train.fp8=mxfp4"], 4, "train.fp8: Invalid value 'mxfp4', expected one of ['delayed', 'tensorwise', "
         "'blockwise', 'mxfp8']"),
        (["train.fused_cross_entropy=true"], 4, "train.fused_cross_entropy=True is invalid: needs train.precision=bf16"),
        (["model.attention_dropout=0.1", "data.reset_attention_mask=true", "model.attention_backend=local"], 4,
         "runs FlexAttention on a GPU, which has no attention dropout"),
        (["train.cuda_graph_impl=local", "train.rerun_mode=validate_results", "model.hidden_dropout=0.1",
          "parallel.pipeline_model_parallel_size=1"], 4, "train.rerun_mode='validate_results' is invalid: a re-run "
         "restores the random streams it saved"),
    ],
)
def test_invalid_layouts_name_the_key_value_and_valid_choice(overrides, world, fragment):
    with pytest.raises(ConfigError) as err:
        validate_layout(tiny(*overrides), world_size=world)
    assert fragment in str(err.value)


@pytest.mark.parametrize("overrides, fragment", [
    (["logging.profile_steps=[3,2]"], "logging.profile_steps=[3, 2] is invalid: must be [first, last]"),
    (["logging.profile_steps=[1,500]"], "<= train.train_iters (120)"),
    (["logging.profile_steps=[1,2]", "logging.profile_ranks=[4]"], "logging.profile_ranks=[4] is invalid"),
    (["logging.memory_snapshot=true"], "is taken at the end of logging.profile_steps"),
    (["checkpoint.save_interval_minutes=0"], "checkpoint.save_interval_minutes=0.0 is invalid: must be > 0"),
    (["train.spike_policy=rewind", "checkpoint.save=null"], "train.spike_policy='rewind' is invalid: goes back to the "
     "newest checkpoint in checkpoint.save"),
    (["train.recurring_fault=rerun_elsewhere"], "train.recurring_fault='rerun_elsewhere' is invalid: re-runs a step "
     "whose fault recurred in place on other GPUs"),
    (["train.recurring_fault=rerun_elsewhere", "train.rerun_mode=validate_results", "checkpoint.save=null"],
     "set train.rerun_mode=validate_results and checkpoint.save"),
    (["parallel.use_megatron_fsdp=true", "parallel.pipeline_model_parallel_size=1",
      "checkpoint.optimizer_format=dp_reshardable"], "Megatron-FSDP runs write megatron-core's fsdp_dtensor format"),
])
def test_invalid_run_settings_name_the_key(overrides, fragment):
    from megatron_ext.config.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny(*overrides), world_size=4)
    assert fragment in str(err.value)
    validate(tiny("logging.profile_steps=[2,2]", "logging.profile_ranks=[0,3]"), world_size=4)
    validate(tiny("train.recurring_fault=rerun_elsewhere", "train.rerun_mode=validate_results"), world_size=4)


def test_wandb_without_its_package_is_one_line_before_launch(monkeypatch):
    import importlib.util

    from megatron_ext.config.validate import validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="logging.wandb_project='p' is invalid: needs the wandb package here: pip "):
        validate(tiny("logging.wandb_project=p"), world_size=4)


def test_fp8_needs_an_fp8_gpu_and_bf16_even_with_te():
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        validate_layout(tiny("train.fp8=tensorwise", "train.precision=bf16"), 4, te_available=True)
    with pytest.raises(ConfigError, match="FP8 training needs train.precision=bf16"):
        validate_layout(tiny("train.fp8=delayed"), 4, te_available=True, compute_capability=(9, 0))
    validate_layout(tiny("train.fp8=delayed", "train.precision=bf16"), 4, te_available=True,
                    compute_capability=(8, 9))


@pytest.mark.parametrize("local", [["model.attention_backend=local"],
                                   ["model.attention_backend=local", "train.compile=true"]])
def test_fp8_with_local_layers_is_refused_naming_the_keys(local):
    """Local layers ignore TE's fp8_autocast: without this rule the run trains in BF16 silently."""
    with pytest.raises(ConfigError, match=r"train.fp8='delayed' is invalid: FP8 runs only in TransformerEngine's "
                                          r"layers, and model.attention_backend=local"):
        validate_layout(tiny("train.fp8=delayed", "train.precision=bf16", *local), 4, te_available=True,
                        compute_capability=(9, 0))


def test_compile_is_for_the_local_layer_spec():
    with pytest.raises(ConfigError, match="train.compile=True is invalid: compiles megatron-core's local layers"):
        validate_layout(tiny("train.compile=true"), 4, te_available=True)
    validate_layout(tiny("train.compile=true", "model.attention_backend=local"), 4, te_available=True)
    validate_layout(tiny("train.compile=true"), 4, te_available=False)



def test_compile_auto_leaves_moe_layers_eager_on_a_gpu():
    """inductor failed on megatron-core's MoE layer on an H100 (docs/measurements/h100-2026-11-26.md): `auto`
    compiles dense local layers only; an explicit true is the user's choice."""
    moe = load_config(ROOT / "configs" / "tiny_moe.yaml")
    assert resolve_kernel_options(moe, on_gpu=True, use_te=False).train.compile is False
    forced = load_config(ROOT / "configs" / "tiny_moe.yaml", ["train.compile=true"])
    assert resolve_kernel_options(forced, on_gpu=True, use_te=False).train.compile is True


def test_tes_attention_kernel_is_a_key_and_the_nvte_variables_that_contradict_it_are_one_line(monkeypatch):
    """On an H100 whose cuDNN did not match the TE build, TE's fused attention failed and NVTE_FUSED_ATTN=0 tripped
    megatron-core's assertion inside the model build (docs/measurements/h100-2026-11-26.md)."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_ext.config.kernels import refuse_what_this_machine_cannot_run
    from megatron_ext.model.llama import transformer_config

    unfused = tiny("model.te_attention_kernel=unfused")
    assert transformer_config(unfused, on_gpu=False, use_te=True).attention_backend == AttnBackend.unfused
    assert transformer_config(tiny(), on_gpu=False, use_te=True).attention_backend == AttnBackend.auto
    with pytest.raises(ConfigError, match="model.te_attention_kernel='unfused' is invalid: chooses TransformerEngine"):
        refuse_what_this_machine_cannot_run(unfused, on_gpu=True, te_available=False)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    refuse_what_this_machine_cannot_run(unfused, on_gpu=True, te_available=True)
    refuse_what_this_machine_cannot_run(tiny(), on_gpu=True, te_available=False)  # local layers: TE reads nothing
    with pytest.raises(ConfigError, match=r"model.te_attention_kernel=auto is invalid: the environment sets "
                                          r"NVTE_FUSED_ATTN=0, .* set model.te_attention_kernel=flash or unfused$"):
        refuse_what_this_machine_cannot_run(tiny(), on_gpu=True, te_available=True)

@pytest.mark.parametrize("on_gpu, use_te, precision, compiled, fused_ce", [
    (True, False, "bf16", True, True),  # a bare GPU: compiled local layers (measured +13-20 % on an H100)
    (True, True, "bf16", False, True),  # TransformerEngine layers bring their own kernels
    (False, False, "fp32", False, False),  # CPU rehearsal; the fused cross-entropy is bf16-only
    (False, False, "bf16", False, True),
])
def test_auto_kernel_options_follow_the_machine(on_gpu, use_te, precision, compiled, fused_ce):
    cfg = tiny(f"train.precision={precision}")
    assert (cfg.train.compile, cfg.train.fused_cross_entropy) == ("auto", "auto")
    validate_layout(cfg, 4, te_available=use_te)
    resolved = resolve_kernel_options(cfg, on_gpu, use_te)
    assert (resolved.train.compile, resolved.train.fused_cross_entropy) == (compiled, fused_ce)
    explicit = resolve_kernel_options(tiny("train.compile=false", "train.fused_cross_entropy=false"), on_gpu, use_te)
    assert (explicit.train.compile, explicit.train.fused_cross_entropy) == (False, False)


def test_kernel_options_are_true_false_or_auto():
    with pytest.raises(ConfigError, match=r"train.compile: Invalid value 'always', expected one of \[True, False, 'auto'\]"):
        validate_layout(tiny("train.compile=always"), 4)


def test_interleaving_needs_microbatches_divisible_by_pp():
    cfg = tiny("model.num_layers=8", "parallel.virtual_pipeline_model_parallel_size=2",
               "train.global_batch_size=12")
    with pytest.raises(ConfigError, match="number of microbatches \\(3\\)"):
        validate_layout(cfg, world_size=4)


def test_uneven_pipeline_split_with_one_override_is_valid():
    validate_layout(tiny("model.num_layers=5", "parallel.num_layers_in_first_pipeline_stage=1"), world_size=4)


def test_unknown_key_and_bad_type_are_reported_with_the_key():
    with pytest.raises(ConfigError, match="parallel.tensor_parallel"):
        tiny("parallel.tensor_parallel=2")
    with pytest.raises(ConfigError, match="train.train_iters"):
        tiny("train.train_iters=many")
    with pytest.raises(ConfigError, match="not of the form"):
        tiny("train.train_iters")
    # the overrides are merged at once; the one refused is still the one named, after good ones
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["train.train_iters=5", "model.num_layers=two", "parallel.tensor_parallel=2"])
    assert str(err.value).startswith("override 'model.num_layers=two': model.num_layers: "), err.value
    cfg = load_config(TINY, ["train.train_iters=5", "train.train_iters=7", "model.num_layers=3"])
    assert (cfg.train.train_iters, cfg.model.num_layers) == (7, 3)  # in order: the last of a key's values counts


def test_a_retired_key_names_its_successor_and_a_saved_config_drops_it(tmp_path):
    from megatron_ext.config.schema import without_retired_keys

    with pytest.raises(ConfigError) as err:
        tiny("logging.loss_spike_factor=1.5")
    assert str(err.value) == ("override 'logging.loss_spike_factor=1.5': logging.loss_spike_factor: was replaced by "
                              "train.spike_threshold (now in median absolute deviations above the median)")
    recipe = tmp_path / "old.yaml"
    recipe.write_text("logging:\n  log_interval: 1\n  loss_spike_window: 50\n")
    with pytest.raises(ConfigError, match=r"old.yaml:3: logging.loss_spike_window: was replaced by train.spike_window"):
        load_config(recipe)
    saved = {"logging": {"loss_spike_factor": 1.5, "loss_spike_window": 50, "log_interval": 5}, "train": {}}
    assert without_retired_keys(saved) == {"logging": {"log_interval": 5}, "train": {}}
    assert saved["logging"]["loss_spike_factor"] == 1.5  # the checkpoint's own dict is left alone


def test_yaml_errors_point_at_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: 4\n  hidden_size: wide\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: model.hidden_size"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_missing_data_files_are_named():
    with pytest.raises(ConfigError, match=r"nowhere/x.bin does not exist"):
        validate_data(tiny("data.blend=[nowhere/x]"))


@pytest.mark.parametrize("damage, fragment", [
    ("cut the .bin to 1 MB", r"x\.bin is 1,000,000 bytes, but .*x\.idx describes 3,764,364 bytes of tokens \(416 "
                             r"sequences of uint16\): the \.bin is cut short or belongs to another index; re-run "
                             r"data_prep.preprocess for it, or copy both files again"),
    ("write another header", r"x\.idx is not a megatron-core index \(version 1\) it can read: bad header"),
    ("write another version", r"x\.idx is not a megatron-core index \(version 1\) it can read: bad version"),
    ("cut the .idx", r"x\.idx is not a megatron-core index \(version 1\) it can read"),
    # forged values megatron-core's C++ index builder would follow out of bounds (no checks there: SIGSEGV)
    ("a negative length", r"x\.idx is inconsistent: sequence 7 has length -5; re-run data_prep"),
    ("a pointer off its place", r"x\.idx is inconsistent: sequence 9 starts at byte 1, not "),
    ("a document boundary past the end", r"x\.idx is inconsistent: its document boundaries are not a rising list "
                                         r"from 0 to the sequence count 416"),
])
def test_a_damaged_dataset_is_one_error_naming_its_files(damage, fragment, tmp_path):
    """Before any rank starts: not a traceback from the first read past the end of a short .bin."""
    source = ROOT / "data" / "tiny" / "stdlib_text_document"
    prefix = tmp_path / "x"
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{source}{suffix}", f"{prefix}{suffix}")
    if damage == "cut the .bin to 1 MB":
        os.truncate(f"{prefix}.bin", 1_000_000)
    elif damage == "cut the .idx":
        os.truncate(f"{prefix}.idx", 100)
    elif damage in ("a negative length", "a pointer off its place", "a document boundary past the end"):
        count = 416  # sequences (and 417 document boundaries): header 9 + version 8 + dtype 1 + two counts 16 = 34
        at, value = {"a negative length": (34 + 4 * 7, (-5).to_bytes(4, "little", signed=True)),
                     "a pointer off its place": (34 + 4 * count + 8 * 9, (1).to_bytes(8, "little")),
                     "a document boundary past the end": (34 + 12 * count + 8 * 5, (10**6).to_bytes(8, "little"))
                     }[damage]
        with open(f"{prefix}.idx", "r+b") as f:
            f.seek(at)
            f.write(value)
    else:
        with open(f"{prefix}.idx", "r+b") as f:
            f.seek(0 if damage == "write another header" else 9)
            f.write(b"XXIDIDX\x00\x00" if damage == "write another header" else (2).to_bytes(8, "little"))
    with pytest.raises(ConfigError, match=fragment):
        validate_data(tiny(f"data.blend=[{prefix}]", f"data.path_to_cache={tmp_path / 'cache'}"))


def test_checkpoint_optimizer_format_is_one_of_megatron_cores():
    with pytest.raises(ConfigError, match=r"checkpoint.optimizer_format: Invalid value 'fully_sharded_model_space', "
                                          r"expected one of \['auto', 'dp_reshardable', 'fully_reshardable'"):
        tiny("checkpoint.optimizer_format=fully_sharded_model_space")


def test_blend_forms():
    assert parse_blend(["a", "b"], "data.blend") == (["a", "b"], None)
    assert parse_blend([0.3, "a", 0.7, "b"], "data.blend") == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ConfigError, match="weight1, prefix1"):
        parse_blend([0.3, "a", "b"], "data.blend")
    with pytest.raises(ConfigError, match="every weight must be > 0"):
        parse_blend([0.0, "a"], "data.blend")


def test_liger_kernels_are_refused_where_they_cannot_run():
    """Triton kernels: never on CPU (the rehearsal keeps megatron-core's own, no silent numerics change), never
    with TE's fused layers, and a missing liger-kernel says how to install it."""
    cfg = load_config(TINY, ["train.liger_kernels=true"])
    with pytest.raises(ConfigError, match=r"train.liger_kernels=True is invalid: liger-kernel's kernels are Triton "
                                          r"and need a GPU"):
        resolve_kernel_options(cfg, on_gpu=False, use_te=False)
    with pytest.raises(ConfigError, match=r"with TransformerEngine set model.attention_backend=local"):
        resolve_kernel_options(cfg, on_gpu=True, use_te=True)
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(ConfigError, match=r"pip install liger-kernel==0.8.5"):
            resolve_kernel_options(cfg, on_gpu=True, use_te=False)
    assert resolve_kernel_options(load_config(TINY, []), on_gpu=False, use_te=False).train.liger_kernels is False


def test_fused_linear_cross_entropy_is_refused_where_it_cannot_run():
    """liger's fused output layer needs a GPU and the whole vocabulary per rank, and replaces the fused CE."""
    cfg = load_config(TINY, ["train.fused_linear_cross_entropy=true"])  # tiny is TP2
    with pytest.raises(ConfigError, match=r"train.fused_linear_cross_entropy=True is invalid: needs the whole "
                                          r"vocabulary on each rank"):
        validate_layout(cfg, 4)
    one_gpu = ["train.fused_linear_cross_entropy=true", "parallel.tensor_model_parallel_size=1",
               "parallel.sequence_parallel=false"]
    with pytest.raises(ConfigError, match=r"train.fused_cross_entropy=True is invalid: replaced by "
                                          r"train.fused_linear_cross_entropy=true"):
        validate_layout(load_config(TINY, [*one_gpu, "train.precision=bf16", "train.fused_cross_entropy=true"]), 2)
    cfg = load_config(TINY, [*one_gpu, "train.precision=bf16"])
    validate_layout(cfg, 2)
    with pytest.raises(ConfigError, match=r"train.fused_linear_cross_entropy=True is invalid: liger-kernel's "
                                          r"kernels are Triton and need a GPU"):
        resolve_kernel_options(cfg, on_gpu=False, use_te=False)
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(ConfigError, match=r"train.fused_linear_cross_entropy=True needs liger-kernel"):
            resolve_kernel_options(cfg, on_gpu=True, use_te=False)


def test_cuda_graphs_are_refused_where_they_cannot_run_and_turn_compile_auto_off():
    """megatron-core's layer graphs: a GPU, its local layers, eager, pipeline size 1, no full recompute."""
    one_gpu = ["train.cuda_graph_impl=local", "parallel.tensor_model_parallel_size=1",
               "parallel.sequence_parallel=false", "parallel.pipeline_model_parallel_size=1"]
    for extra, world, message in [
        ("train.compile=true", 1, r"train.compile=True is invalid: train.cuda_graph_impl=local captures eager layers"),
        ("train.recompute_granularity=full", 1, r"train.recompute_granularity='full' is invalid: megatron-core "
                                                r"captures no layer graphs under full recompute"),
        ("parallel.pipeline_model_parallel_size=2", 2, r"parallel.pipeline_model_parallel_size=2 is invalid: "
                                                       r"train.cuda_graph_impl=local keeps graphs per micro batch"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_layout(load_config(TINY, [*one_gpu, extra]), world)
    cfg = load_config(TINY, one_gpu)
    validate_layout(cfg, 1)
    with pytest.raises(ConfigError, match=r"train.cuda_graph_impl='local' is invalid: CUDA graphs need a GPU"):
        resolve_kernel_options(cfg, on_gpu=False, use_te=False)
    with pytest.raises(ConfigError, match=r"train.cuda_graph_impl='local' is invalid: captures megatron-core's "
                                          r"local layers"):
        resolve_kernel_options(cfg, on_gpu=True, use_te=True)
    resolved = resolve_kernel_options(cfg, on_gpu=True, use_te=False).train
    assert resolved.cuda_graph_impl == "local" and resolved.compile is False  # auto: graphs of eager layers
    assert resolve_kernel_options(load_config(TINY, one_gpu[1:]), on_gpu=True, use_te=False).train.compile is True


def test_the_key_reference_covers_every_key_with_help():
    """`python -m recipes.pretrain --list-keys` (docs/config-keys.md, tests/unit/test_generated_docs.py) covers every
    key of the schema, each with its help."""
    assert keys_table().count("\n| `") == len(list(config_keys()))
    keys = list(config_keys())
    assert len(keys) == sum(len(dataclasses.fields(s.default_factory)) for s in dataclasses.fields(RecipeConfig))
    assert not [k.key for k in keys if not k.help], "keys without a help comment in megatron_ext/config/schema.py"


def test_an_enum_like_value_outside_its_literal_fails_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"model.attention_backend: Invalid value 'sdpa', expected one of "
                                          r"\['auto', 'te', 'local'\]"):
        tiny("model.attention_backend=sdpa")
    cfg = tiny()
    cfg.train.recompute_granularity = "partial"  # set in code, not loaded: validation still names the values
    with pytest.raises(ConfigError, match=r"train.recompute_granularity='partial' is invalid: one of null, "
                                          r"selective, full"):
        validate(cfg, world_size=4)


@pytest.mark.parametrize("world, batch, trained", [
    (4, 8, 4),  # fits: TP1 × PP2, DP 2
    (5, 8, 4),  # not a multiple of PP2
    (6, 8, 4),  # DP 3 does not divide 8 / micro batch 2 = 4
    (6, 12, 6),  # DP 3 divides 6
    (3, 8, 2),
])
def test_a_world_the_layout_does_not_fit_trains_on_the_largest_that_fits(world, batch, trained):
    """parallel.allow_idle_ranks: the largest world of whole TP × PP × CP groups whose DP divides the global batch;
    the started world's reason is kept for the line; without the key the started world's error stands."""
    layout = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
              f"train.global_batch_size={batch}", "train.micro_batch_size=2"]
    chosen = trained_world(load_config(TINY, [*layout, "parallel.allow_idle_ranks=true"]), world)
    assert chosen.size == trained and (chosen.idle_because is None) == (world == trained)
    if world != trained:
        assert "world size" in chosen.idle_because or "train.global_batch_size" in chosen.idle_because
        with pytest.raises(ConfigError):
            trained_world(load_config(TINY, layout), world)


def test_idle_ranks_cannot_rescue_a_world_smaller_than_one_model_replica():
    cfg = load_config(TINY, ["parallel.allow_idle_ranks=true"])  # TP2 × PP2
    with pytest.raises(ConfigError, match="world size"):
        trained_world(cfg, 3)


@pytest.mark.parametrize("style", get_args(LRDecayStyle))
def test_every_lr_decay_style_that_validates_builds_megatron_cores_schedule(style):
    """Each accepted schedule builds megatron-core's OptimizerParamScheduler (WSD with its anneal length, which it
    asserts on) and gives the peak after warm-up and min_lr at the end."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_ext.training.optimizer import build_scheduler

    wsd = ["optimizer.lr_wsd_decay_iters=20"] if style == "WSD" else []
    cfg = load_config(TINY, [f"optimizer.lr_decay_style={style}", "optimizer.lr_warmup_iters=10",
                             "optimizer.lr_decay_iters=100", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", *wsd])
    validate(cfg, 4)
    group = {"lr": 0.0, "weight_decay": 0.0}
    scheduler = build_scheduler(cfg, SimpleNamespace(param_groups=[group]))
    assert isinstance(scheduler, OptimizerParamScheduler)
    scheduler.step(10)
    assert group["lr"] == pytest.approx(1e-3)
    scheduler.step(90)
    end = {"constant": 1e-3, "inverse-square-root": 1e-3 * (10 / 100) ** 0.5}.get(style, 1e-4)
    assert group["lr"] == pytest.approx(end)


def _enum_values() -> list[tuple[str, object]]:
    """Every value a Literal-typed key admits (booleans and null aside), as (section.key, value)."""
    import typing

    from megatron_ext.config.schema import allowed_values

    pairs = []
    for section in dataclasses.fields(RecipeConfig):
        hints = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            pairs += [(f"{section.name}.{f.name}", v) for v in allowed_values(hints[f.name])
                      if v is not None and not isinstance(v, bool)]
    return pairs


@pytest.mark.parametrize("key, value", _enum_values(), ids=lambda x: str(x))
def test_every_enum_value_that_validates_builds_megatron_cores_configs(key, value, monkeypatch):
    """A value `validate` accepts (with and without TE's layers, on a Blackwell GPU with DeepEP and HybridEP
    installed) is one megatron-core accepts too: its TransformerConfig, OptimizerConfig, DDP config and LR schedule
    are built from it without training (their own __post_init__ checks and asserts run), so a rejected value is
    caught before launch, not inside Trainer."""
    from megatron.core.transformer.moe import fused_a2a

    from megatron_ext.distributed.parallel import ddp_config
    from megatron_ext.model.llama import transformer_config
    from megatron_ext.training.optimizer import build_scheduler, optimizer_config

    monkeypatch.setattr(fused_a2a, "HAVE_DEEP_EP", True)
    monkeypatch.setattr(fused_a2a, "HAVE_HYBRIDEP", True)
    base = ROOT / "configs" / "tiny_moe.yaml" if ".moe_" in key else TINY
    built = 0
    for use_te in (False, True):
        try:
            cfg = load_config(base, [f"{key}={value}", *_COMPANIONS.get(key, [])])
            validate(cfg, 4, te_available=use_te, compute_capability=(10, 0))
            cfg = resolve_kernel_options(cfg, on_gpu=True, use_te=use_te)
        except ConfigError:
            continue  # refused before launch, with one line
        transformer_config(cfg, on_gpu=False, use_te=use_te)
        optimizer_config(cfg)
        ddp_config(cfg)
        build_scheduler(cfg, SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}]))
        built += 1
    assert built, f"{key}={value} is refused in every setting tried: give it its companion keys in _COMPANIONS"


# Keys whose non-default values need others set with them
_COMPANIONS = {
    "optimizer.lr_decay_style": ["optimizer.lr_wsd_decay_iters=100"],
    "train.fp8": ["train.precision=bf16"],
    "optimizer.name": ["train.precision=bf16"],  # the tiny recipe's fp32 and Muon's layer-wise optimizer
    "optimizer.muon_scale_mode": ["optimizer.name=muon", "train.precision=bf16"],
    "optimizer.muon_tp_mode": ["optimizer.name=muon", "train.precision=bf16"],
    "optimizer.muon_fp32_matmul_prec": ["optimizer.name=muon", "train.precision=bf16"],
    "train.fp4": ["train.precision=bf16"],
    "train.cuda_graph_impl": ["parallel.pipeline_model_parallel_size=1", "logging.step_breakdown=false"],
    "model.moe_flex_dispatcher_backend": ["model.moe_token_dispatcher_type=flex"],
    "train.recurring_fault": ["train.rerun_mode=validate_results"],
    "model.rope_type": ["model.multi_latent_attention=true", "model.num_query_groups=null", "model.q_lora_rank=32",
                        "model.kv_lora_rank=24", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8"],
    "parallel.outer_dp_sharding_strategy": [
        "parallel.use_megatron_fsdp=true", "parallel.num_distributed_optimizer_instances=2", "checkpoint.save=null",
        "parallel.pipeline_model_parallel_size=1", "parallel.tensor_model_parallel_size=1",
        "parallel.sequence_parallel=false"],
}


def test_wsd_without_its_anneal_length_is_refused_before_launch():
    with pytest.raises(ConfigError, match=r"optimizer.lr_wsd_decay_iters=None is invalid: must be set with"):
        validate(load_config(TINY, ["optimizer.lr_decay_style=WSD"]), 4)
    with pytest.raises(ConfigError, match=r"optimizer.lr_wsd_decay_iters=200 is invalid: must fit in the decay"):
        validate(load_config(TINY, ["optimizer.lr_decay_style=WSD", "optimizer.lr_wsd_decay_iters=200"]), 4)


def test_what_this_machine_cannot_run_is_refused_before_any_process_group():
    """The offloads' machine rules, checked by the launcher and by each rank before its process groups: optimizer
    and activation offload on a GPU need TransformerEngine; CPU rehearsal offloads all of the optimizer state or
    none; the kernel rules come with them."""
    from megatron_ext.config.kernels import refuse_what_this_machine_cannot_run as refuse

    offload = load_config(TINY, ["optimizer.optimizer_cpu_offload=true", "train.precision=bf16"])
    refuse(offload, on_gpu=False, te_available=False)
    refuse(offload, on_gpu=True, te_available=True)
    with pytest.raises(ConfigError, match=r"optimizer.optimizer_cpu_offload=True is invalid: megatron-core's offload "
                                          r"on a GPU is not verified here without TransformerEngine"):
        refuse(offload, on_gpu=True, te_available=False)
    half = load_config(TINY, ["optimizer.optimizer_cpu_offload=true", "train.precision=bf16",
                              "optimizer.optimizer_offload_fraction=0.5"])
    refuse(half, on_gpu=True, te_available=True)
    with pytest.raises(ConfigError, match=r"optimizer.optimizer_offload_fraction=0.5 is invalid: in CPU rehearsal"):
        refuse(half, on_gpu=False, te_available=False)
    activations = load_config(TINY, ["train.offload_modules=[core_attn]"])
    refuse(activations, on_gpu=False, te_available=False)
    with pytest.raises(ConfigError, match=r"train.offload_modules=\['core_attn'\] is invalid: megatron-core's "
                                          r"activation offload needs TransformerEngine on a GPU"):
        refuse(activations, on_gpu=True, te_available=False)
    with pytest.raises(ConfigError, match=r"train.cuda_graph_impl='local' is invalid: CUDA graphs need a GPU"):
        refuse(load_config(TINY, ["train.cuda_graph_impl=local"]), on_gpu=False, te_available=False)
