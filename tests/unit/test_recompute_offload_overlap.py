"""train.recompute_modules, train.cpu_offloading_num_layers and parallel.tp_comm_overlap: each reaches megatron-core's
TransformerConfig as asked, what megatron-core (or this machine) refuses is one line before launch, and
TransformerEngine's userbuffers are set up as Megatron-LM sets them up (through a TE-shaped stand-in)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest

from megatron_ext.config.kernels import refuse_what_this_machine_cannot_run, resolve_kernel_options
from megatron_ext.config.schema import load_config
from megatron_ext.config.validate import validate_layout
from megatron_ext.errors import ConfigError
from megatron_ext.model.llama import transformer_config
from tests.launch import ROOT, TINY

TINY_MOE, TINY_DEEPSEEK = ROOT / "configs" / "tiny_moe.yaml", ROOT / "configs" / "tiny_deepseek.yaml"
SELECTIVE = "train.recompute_granularity=selective"
ONE_STAGE = "parallel.pipeline_model_parallel_size=1"


# ---------------------------------------------------------------------------------------------------------------------
# train.recompute_modules


@pytest.mark.parametrize("base, modules, use_te", [
    (TINY, ["layernorm", "mlp"], False),
    (TINY_DEEPSEEK, ["mla_up_proj", "moe", "shared_experts", "core_attn"], False),
    (TINY_MOE, ["moe_act", "layernorm"], True),
])
def test_selective_recompute_modules_reach_megatron_core(base, modules, use_te):
    cfg = load_config(base, [SELECTIVE, f"train.recompute_modules=[{','.join(modules)}]"])
    validate_layout(cfg, 4, te_available=True)  # TE importable; its layers built with `use_te`
    cfg = resolve_kernel_options(cfg, on_gpu=True, use_te=use_te)
    config = transformer_config(cfg, on_gpu=False, use_te=use_te)
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", modules)


@pytest.mark.parametrize("module", ["layernorm", "mla_up_proj"])
def test_modules_megatron_core_recomputes_through_te_state_are_refused_without_te(module):
    """megatron-core 0.19.2's CheckpointWithoutOutput reads TransformerEngine's FP8 state whatever the precision: a
    CPU rehearsal of layernorm recompute failed at its first step (NameError 'FP8GlobalStateManager')."""
    cfg = load_config(TINY_DEEPSEEK, [SELECTIVE, f"train.recompute_modules=[{module},core_attn]"])
    validate_layout(cfg, 4, te_available=True)
    with pytest.raises(ConfigError, match=rf"train.recompute_modules=\['{module}', 'core_attn'\] is invalid: layernorm "
                                          r"and mla_up_proj are recomputed by megatron-core's CheckpointWithoutOutput"):
        validate_layout(cfg, 4, te_available=False)


def test_no_modules_named_is_megatron_cores_default():
    config = transformer_config(load_config(TINY, [SELECTIVE]), on_gpu=False, use_te=False)
    assert config.recompute_modules == ["core_attn"]


@pytest.mark.parametrize("base, overrides, fragment", [
    (TINY, ["train.recompute_modules=[mlp]"], r"train.recompute_modules=\['mlp'\] is invalid: chooses what selective "
     r"recompute repeats: set train.recompute_granularity=selective"),
    (TINY, ["train.recompute_modules=[mlp]", "train.recompute_granularity=full"], r"chooses what selective recompute"),
    (TINY, [SELECTIVE, "train.recompute_modules=[mlp,mlp]"], r"names a module twice"),
    (TINY, [SELECTIVE, "train.recompute_modules=[mla_up_proj]"], r"mla_up_proj recomputes multi-latent attention's "
     r"up-projections, and this model has none"),
    (TINY, [SELECTIVE, "train.recompute_modules=[moe_act]"], r"moe, moe_act and shared_experts recompute parts of MoE "
     r"layers, and this model is dense"),
    (TINY_MOE, [SELECTIVE, "train.recompute_modules=[shared_experts]"], r"shared_experts recomputes the shared "
     r"experts, and this model has none"),
    (TINY_MOE, [SELECTIVE, "train.recompute_modules=[moe_act]", "model.attention_backend=local"], r"moe_act "
     r"recomputes the experts' activation inside TransformerEngine's grouped GEMM"),
    (TINY_MOE, [SELECTIVE, "train.recompute_modules=[mlp]"], r"mlp recomputes the dense MLPs, and every layer of "
     r"this model is an MoE layer"),
    (TINY, [SELECTIVE, "train.recompute_modules=[layernorm]", "train.fp8=delayed", "train.precision=bf16"],
     r"moe_act and layernorm recompute do not run with train.fp8=delayed"),
    (TINY, ["train.recompute_modules=[attention]"], r"train.recompute_modules\[0\]: Invalid value 'attention'"),
])
def test_recompute_modules_megatron_core_refuses_are_one_line(base, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate_layout(load_config(base, overrides), 4, te_available=True, compute_capability=(9, 0))


def test_moe_act_is_refused_where_the_experts_resolve_to_local_ones():
    cfg = load_config(TINY_MOE, [SELECTIVE, "train.recompute_modules=[moe_act]"])
    validate_layout(cfg, 4)  # grouped GEMM auto: on with TE's layers
    with pytest.raises(ConfigError, match=r"train.recompute_modules=\['moe_act'\] is invalid: moe_act recomputes the "
                                          r"experts' activation inside TransformerEngine's grouped GEMM .* this run "
                                          r"builds megatron-core's local experts"):
        resolve_kernel_options(cfg, on_gpu=False, use_te=False)


# ---------------------------------------------------------------------------------------------------------------------
# train.cpu_offloading_num_layers


def test_layer_offload_reaches_megatron_core():
    config = transformer_config(load_config(TINY, [ONE_STAGE, "train.cpu_offloading_num_layers=3"]), on_gpu=True,
                                use_te=True)
    assert (config.cpu_offloading, config.cpu_offloading_num_layers) == (True, 3)
    assert transformer_config(load_config(TINY, [ONE_STAGE]), on_gpu=True, use_te=True).cpu_offloading is False


@pytest.mark.parametrize("overrides, fragment", [
    (["train.cpu_offloading_num_layers=4"], r"train.cpu_offloading_num_layers=4 is invalid: must be below "
     r"model.num_layers=4"),
    (["parallel.pipeline_model_parallel_size=2", "train.cpu_offloading_num_layers=1"],
     r"parallel.pipeline_model_parallel_size=2 is invalid: megatron-core's layer offload .* runs without pipeline"),
    (["train.cpu_offloading_num_layers=1", SELECTIVE], r"train.recompute_granularity='selective' is invalid: "
     r"megatron-core's layer offload .* does not run with activation recompute"),
    (["train.cpu_offloading_num_layers=1", "train.offload_modules=[attn_norm]"], r"train.offload_modules="
     r"\['attn_norm'\] is invalid: megatron-core runs one activation offload at a time"),
    (["train.cpu_offloading_num_layers=1", "model.attention_backend=local"], r"train.cpu_offloading_num_layers=1 is "
     r"invalid: offloads TransformerEngine's layers' activations"),
])
def test_layer_offload_megatron_core_refuses_is_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate_layout(load_config(TINY, [ONE_STAGE, *overrides]), 4, te_available=True)


def test_layer_offload_needs_transformer_engine_on_a_gpu():
    cfg = load_config(TINY, [ONE_STAGE, "train.cpu_offloading_num_layers=2"])
    validate_layout(cfg, 4, te_available=True)
    refuse_what_this_machine_cannot_run(cfg, on_gpu=True, te_available=True)
    with pytest.raises(ConfigError, match=r"^train.cpu_offloading_num_layers=2 is invalid: megatron-core's layer "
                                          r"offload copies activations to pinned host memory on CUDA streams; a CPU "
                                          r"rehearsal keeps them where they are — set train.cpu_offloading_num_layers=0"
                                          r" there$"):
        refuse_what_this_machine_cannot_run(cfg, on_gpu=False, te_available=False)
    with pytest.raises(ConfigError, match=r"is TransformerEngine's CPU-offload context around its layers"):
        refuse_what_this_machine_cannot_run(cfg, on_gpu=True, te_available=False)
    with pytest.raises(ConfigError, match=r"train.cpu_offloading_num_layers=-1 is invalid: must be >= 0"):
        load_config(TINY, ["train.cpu_offloading_num_layers=-1"])


# ---------------------------------------------------------------------------------------------------------------------
# parallel.tp_comm_overlap


def test_tp_comm_overlap_reaches_megatron_core():
    cfg = load_config(TINY, ["parallel.tp_comm_overlap=true"])  # TP2 with sequence parallelism
    validate_layout(cfg, 4, te_available=True)
    assert transformer_config(cfg, on_gpu=True, use_te=True).tp_comm_overlap is True
    assert transformer_config(load_config(TINY), on_gpu=True, use_te=True).tp_comm_overlap is False


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"], r"parallel.tp_comm_overlap=True "
     r"is invalid: overlaps tensor-parallel communication, and parallel.tensor_model_parallel_size=1 has none"),
    (["parallel.sequence_parallel=false"], r"parallel.sequence_parallel=False is invalid: parallel.tp_comm_overlap "
     r"overlaps sequence parallelism's all-gathers and reduce-scatters"),
    (["model.attention_backend=local"], r"parallel.tp_comm_overlap=True is invalid: is TransformerEngine's"),
])
def test_tp_comm_overlap_megatron_core_refuses_is_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate_layout(load_config(TINY, ["parallel.tp_comm_overlap=true", *overrides]), 4, te_available=True)


def test_tp_comm_overlap_needs_transformer_engines_layers_on_gpus():
    cfg = load_config(TINY, ["parallel.tp_comm_overlap=true"])
    refuse_what_this_machine_cannot_run(cfg, on_gpu=True, te_available=True)
    with pytest.raises(ConfigError, match=r"^parallel.tp_comm_overlap=True is invalid: TransformerEngine's userbuffers "
                                          r"overlap the GEMMs with NVLink copies on GPUs; a CPU rehearsal's gloo "
                                          r"collectives have nothing to overlap — set parallel.tp_comm_overlap=false "
                                          r"there$"):
        refuse_what_this_machine_cannot_run(cfg, on_gpu=False, te_available=False)
    with pytest.raises(ConfigError, match=r"parallel.tp_comm_overlap=True is invalid: runs in TransformerEngine's "
                                          r"layers, and this run builds megatron-core's local layers"):
        refuse_what_this_machine_cannot_run(cfg, on_gpu=True, te_available=False)


@pytest.mark.parametrize("te_2_7, fp8", [(True, False), (True, True), (False, True)])
def test_userbuffers_are_set_up_as_megatron_lm_sets_them_up(monkeypatch, te_2_7, fp8):
    """TransformerEngine's initialize_ub (a stand-in with its signature) gets one micro batch's tokens on this CP
    rank × hidden, TP, FP8 quantization with train.fp8 and NCCL bootstrap."""
    import megatron.core.utils

    from megatron_ext.distributed.tp_comm_overlap import initialize_userbuffers

    calls = []
    modes = SimpleNamespace(FP8="fp8", NONE="none")  # TE 2.7+'s UserBufferQuantizationMode
    base = SimpleNamespace(UserBufferQuantizationMode=modes, initialize_ub=lambda **kwargs: calls.append(kwargs))
    te_module = ModuleType("transformer_engine.pytorch.module")
    te_module.base = base
    te_pytorch = ModuleType("transformer_engine.pytorch")
    te_pytorch.module = te_module
    te = ModuleType("transformer_engine")
    te.pytorch = te_pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pytorch)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.module", te_module)
    monkeypatch.setattr(megatron.core.utils, "is_te_min_version", lambda version: te_2_7)

    initialize_userbuffers(load_config(TINY))  # off: nothing set up
    assert calls == []
    overlap = ["parallel.tp_comm_overlap=true", "parallel.context_parallel_size=2", "model.seq_length=256",
               "train.micro_batch_size=2", *(["train.fp8=tensorwise", "train.precision=bf16"] if fp8 else [])]
    initialize_userbuffers(load_config(TINY, overlap))
    quantization = {"quantization_modes": ["fp8" if fp8 else "none"]} if te_2_7 else {"use_fp8": fp8}
    assert calls == [{"shape": [256 * 2 // 2, 256], "tp_size": 2, **quantization, "ub_cfgs": {},
                      "bootstrap_backend": "nccl"}]
