"""train.cuda_graph_impl and train.cuda_graph_modules without a GPU: each implementation reaches megatron-core's
TransformerConfig (and its RNG tracker) as asked, what megatron-core or this loop refuses is one line before launch, the
loop drives TransformerEngine's capture and the full-iteration wrapper as Megatron-LM does, and graph-safe RNG streams
checkpoint as plain state tensors."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.checkpoint.rng import tracker_states_as_tensors
from megatron_ext.config.kernels import resolve_kernel_options
from megatron_ext.config.schema import load_config
from megatron_ext.config.validate import validate_layout
from megatron_ext.distributed.parallel import rng_tracker_options
from megatron_ext.errors import ConfigError
from megatron_ext.model.llama import transformer_config
from megatron_ext.training.cuda_graphs import StepGraphs
from tests.launch import ROOT, TINY

ONE_STAGE = ["parallel.pipeline_model_parallel_size=1"]  # TP2 × DP2 on 4 ranks
TINY_MOE = ROOT / "configs" / "tiny_moe.yaml"  # 8 experts, EP2; at PP1: DP4
STATIC_MOE = ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"]


def test_transformer_config_asks_megatron_core_for_whole_layer_graphs_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # megatron-core's default scope "full" warns that it is deprecated
        graphed = transformer_config(load_config(None, ["train.cuda_graph_impl=local"]), on_gpu=True, use_te=False)
        eager = transformer_config(load_config(None, []), on_gpu=True, use_te=False)
    assert (graphed.cuda_graph_impl, graphed.cuda_graph_modules) == ("local", [])  # [] = the whole layer
    assert eager.cuda_graph_impl == "none"


@pytest.mark.parametrize("impl, modules", [("transformer_engine", ["attn", "mlp"]), ("transformer_engine", []),
                                           ("full_iteration", []), ("local", ["attn"])])
def test_each_implementation_and_its_regions_reach_megatron_cores_transformer_config(impl, modules):
    from megatron.core.transformer.enums import CudaGraphModule

    cfg = load_config(TINY, [f"train.cuda_graph_impl={impl}", f"train.cuda_graph_modules=[{','.join(modules)}]"])
    config = transformer_config(cfg, on_gpu=True, use_te=impl == "transformer_engine")
    assert config.cuda_graph_impl == impl
    assert config.cuda_graph_modules == [CudaGraphModule[name] for name in modules]


def test_the_retired_bool_names_its_successor():
    with pytest.raises(ConfigError, match=r"train.cuda_graphs: was replaced by train.cuda_graph_impl=local"):
        load_config(TINY, ["train.cuda_graphs=true"])


@pytest.mark.parametrize("impl, use_te, expected", [
    ("none", True, {"te_rng_tracker": False, "use_cudagraphable_rng": False}),
    ("local", False, {"te_rng_tracker": False, "use_cudagraphable_rng": True}),
    ("transformer_engine", True, {"te_rng_tracker": True, "use_cudagraphable_rng": True}),
    ("full_iteration", False, {"te_rng_tracker": False, "use_cudagraphable_rng": True}),
    ("full_iteration", True, {"te_rng_tracker": True, "use_cudagraphable_rng": True}),
])
def test_graphs_replay_through_graph_safe_rng_streams_as_megatron_lm_chooses_them(impl, use_te, expected):
    cfg = load_config(TINY, [f"train.cuda_graph_impl={impl}"])
    assert rng_tracker_options(cfg, on_gpu=True, use_te=use_te) == expected
    assert rng_tracker_options(cfg, on_gpu=False, use_te=use_te) == {"te_rng_tracker": False,
                                                                    "use_cudagraphable_rng": False}


@pytest.mark.parametrize("base, overrides, fragment", [
    # every implementation
    (TINY, ["train.cuda_graph_modules=[attn]"], r"train.cuda_graph_modules=\['attn'\] is invalid: chooses what "
     r"per-layer CUDA graphs capture"),
    (TINY, ["train.cuda_graph_impl=transformer_engine"], r"parallel.pipeline_model_parallel_size=2 is invalid: "
     r"train.cuda_graph_impl=transformer_engine keeps graphs per micro batch"),
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=full_iteration", "model.attention_backend=local", "train.compile=true"],
     r"train.compile=True is invalid: train.cuda_graph_impl=full_iteration captures eager layers"),
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.offload_modules=[attn_norm]"],
     r"train.offload_modules=\['attn_norm'\] is invalid: activation offload inside captured CUDA graphs"),
    (TINY, ["train.cuda_graph_impl=transformer_engine", "train.cpu_offloading_num_layers=1", *ONE_STAGE],
     r"train.cpu_offloading_num_layers=1 is invalid: megatron-core's layer offload does not run inside per-layer"),
    # full iteration
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=full_iteration"], r"logging.step_breakdown=True is invalid: times "
     r"megatron-core's regions inside the schedule"),
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=full_iteration", "logging.step_breakdown=false",
            "train.cuda_graph_modules=[attn]"], r"train.cuda_graph_modules=\['attn'\] is invalid: must be \[\] with "
     r"train.cuda_graph_impl=full_iteration"),
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=full_iteration", "logging.step_breakdown=false",
            "data.reset_position_ids=true"], r"data.reset_position_ids=True is invalid: restarts RoPE at documents"),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=full_iteration", "logging.step_breakdown=false"],
     r"model.moe_pad_expert_input_to_capacity=False is invalid: a dropless MoE layer's token dispatcher"),
    # per-layer regions (megatron-core's rules)
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[moe_router]"],
     r"moe, moe_router and moe_preprocess capture parts of MoE layers, and this model has none"),
    (TINY_MOE, [*ONE_STAGE, *STATIC_MOE, "train.cuda_graph_impl=transformer_engine",
                "train.cuda_graph_modules=[moe,moe_router]"], r"must not hold both moe and moe_router"),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[moe_preprocess]"],
     r"moe_preprocess is captured with the router: add moe_router"),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[mlp]"],
     r"mlp captures dense MLPs, and every layer of this model is an MoE layer"),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[moe]"],
     r"moe captures whole MoE layers, which needs static shapes"),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "model.moe_expert_capacity_factor=1.0",
                "train.cuda_graph_modules=[moe_router,moe_preprocess]"], r"moe_preprocess cannot be captured with the "
     r"alltoall dispatcher and a capacity factor"),
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.recompute_granularity=full"],
     r"train.recompute_granularity='full' is invalid: megatron-core captures no layer graphs under full recompute"),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[moe_router]",
                "train.recompute_granularity=selective", "train.recompute_modules=[moe]"],
     r"moe recompute covers the router that train.cuda_graph_modules' moe_router captures"),
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "model.attention_dropout=0.1",
            "train.recompute_granularity=selective"], r"model.attention_dropout=0.1 is invalid: attention dropout does "
     r"not run in a recomputed core attention inside a CUDA graph"),
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "model.hidden_dropout=0.1",
            "train.recompute_granularity=selective", "train.recompute_modules=[mlp]",
            "train.cuda_graph_modules=[mlp]"], r"model.hidden_dropout=0.1 is invalid: hidden dropout does not run in a "
     r"recomputed MLP"),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.precision=bf16",
                "parallel.overlap_moe_expert_parallel_comm=true"], r"parallel.overlap_moe_expert_parallel_comm=True is "
     r"invalid: per-layer CUDA graphs \(train.cuda_graph_impl=transformer_engine\) with the overlapped expert "
     r"all-to-alls are not wired here"),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=local"], r"train.cuda_graph_impl='local' is invalid: is not "
     r"verified with MoE models here"),
])
def test_what_megatron_core_or_this_loop_refuses_under_graphs_is_one_line_before_launch(base, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate_layout(load_config(base, overrides), 4, te_available=True, compute_capability=(9, 0))


@pytest.mark.parametrize("base, overrides", [
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=full_iteration", "logging.step_breakdown=false",
            "train.recompute_granularity=full"]),  # megatron-core's full-iteration graph takes full recompute
    (TINY_MOE, [*ONE_STAGE, *STATIC_MOE, "train.cuda_graph_impl=full_iteration", "logging.step_breakdown=false"]),
    (TINY_MOE, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[attn,moe_router,"
                "moe_preprocess]"]),
    (TINY_MOE, [*ONE_STAGE, *STATIC_MOE, "train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[moe]"]),
    (TINY, [*ONE_STAGE, "train.cuda_graph_impl=transformer_engine", "model.attention_dropout=0.1",
            "train.recompute_granularity=selective", "train.cuda_graph_modules=[mlp]"]),  # attention runs eagerly
])
def test_the_combinations_megatron_core_captures_are_accepted_and_reach_its_config(base, overrides):
    cfg = load_config(base, overrides)
    validate_layout(cfg, 4, te_available=True, compute_capability=(9, 0))
    config = transformer_config(resolve_kernel_options(cfg, on_gpu=True, use_te=True), on_gpu=False, use_te=True)
    assert config.cuda_graph_impl == cfg.train.cuda_graph_impl


def test_each_implementation_needs_a_gpu_and_the_layers_it_captures():
    for impl in ("local", "transformer_engine", "full_iteration"):
        with pytest.raises(ConfigError, match=rf"train.cuda_graph_impl='{impl}' is invalid: CUDA graphs need a GPU; "
                                              r"a CPU rehearsal runs the same layers eagerly"):
            resolve_kernel_options(load_config(TINY, [f"train.cuda_graph_impl={impl}"]), on_gpu=False, use_te=False)
    with pytest.raises(ConfigError, match=r"train.cuda_graph_impl='transformer_engine' is invalid: captures "
                                          r"TransformerEngine's layers"):
        resolve_kernel_options(load_config(TINY, ["train.cuda_graph_impl=transformer_engine"]), on_gpu=True,
                               use_te=False)
    full = load_config(TINY, ["train.cuda_graph_impl=full_iteration"])
    for use_te in (False, True):  # the whole schedule, whichever layers
        assert resolve_kernel_options(full, on_gpu=True, use_te=use_te).train.compile is False


def test_te_graphs_under_expandable_segments_need_nccl_graph_registration_off(monkeypatch):
    """megatron-core's TECudaGraphHelper asserts it mid start-up; the launcher says it first, in one line."""
    from megatron_ext.config.kernels import refuse_what_this_machine_cannot_run

    cfg = load_config(TINY, ["train.cuda_graph_impl=transformer_engine"])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    with pytest.raises(ConfigError, match=r"train.cuda_graph_impl='transformer_engine' is invalid: the environment "
                                          r"sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        refuse_what_this_machine_cannot_run(cfg, on_gpu=True, te_available=True)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    refuse_what_this_machine_cannot_run(cfg, on_gpu=True, te_available=True)


class _Chunk:
    """A DDP-wrapped model chunk as far as the capture touches it: the overlapped param gather's forward hooks."""

    def __init__(self, calls: list):
        self.calls = calls

    def disable_forward_pre_hook(self, param_sync: bool = True):
        self.calls.append(("disable hooks", param_sync))

    def enable_forward_pre_hook(self):
        self.calls.append("enable hooks")


class _TEHelper:
    """megatron-core's TECudaGraphHelper as the loop calls it (its capture needs TE on a GPU)."""

    def __init__(self, calls: list, **kwargs):
        self.calls, self.kwargs, self.captured = calls, kwargs, False

    def capture_finished(self):
        return self.captured

    def create_cudagraphs(self):
        self.calls.append("capture")
        self.captured = True

    def cuda_graph_set_manual_hooks(self):
        self.calls.append("manual hooks")

    def graphs_created(self):
        return self.captured

    def delete_cuda_graphs(self):
        self.calls.append("delete")


def test_transformer_engines_layers_are_captured_once_after_the_warm_up_steps_with_the_hooks_set_by_hand(
        monkeypatch):
    from megatron.core.transformer import cuda_graphs

    calls: list = []
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", lambda **kwargs: _TEHelper(calls, **kwargs))
    cfg = load_config(TINY, ["train.cuda_graph_impl=transformer_engine", "parallel.overlap_param_gather=true"])
    config = SimpleNamespace(cuda_graph_warmup_steps=3, cuda_graph_use_single_mempool=True)
    graphs = StepGraphs(cfg, config, [_Chunk(calls)], optimizer="opt", start_iteration=10)
    assert graphs.te_helper.kwargs["seq_length"] == cfg.model.seq_length and graphs.te_helper.kwargs["optimizers"] \
        == ["opt"]
    assert [graphs.before_step(i) for i in range(10, 15)] == [False, False, False, True, False]
    assert calls == [("disable hooks", False), "capture", "enable hooks", "manual hooks"]
    graphs.close()
    assert calls[-1] == "delete"
    forward_backward = object()
    assert graphs.schedule(forward_backward) is forward_backward  # per-layer graphs: the schedule runs as it is


def test_a_full_iteration_graph_wraps_the_schedule_once_and_its_results_are_copied_out(monkeypatch):
    from megatron.core import full_cuda_graph

    built = []

    class Wrapper:
        def __init__(self, forward_backward, cuda_graph_warmup_steps, use_single_mempool):
            built.append((forward_backward, cuda_graph_warmup_steps, use_single_mempool))

    monkeypatch.setattr(full_cuda_graph, "FullCudaGraphWrapper", Wrapper)
    cfg = load_config(TINY, ["train.cuda_graph_impl=full_iteration"])
    config = SimpleNamespace(cuda_graph_warmup_steps=3, cuda_graph_use_single_mempool=True)
    graphs = StepGraphs(cfg, config, [], optimizer=None, start_iteration=0)
    wrapped = graphs.schedule("schedule")
    assert graphs.schedule("schedule") is wrapped and built == [("schedule", 3, True)]
    static = [{"lm loss": torch.tensor([2.0, 8.0])}]
    kept = graphs.results(static)
    static[0]["lm loss"].fill_(0.0)  # the next replay writes into the graph's static output
    assert kept[0]["lm loss"].tolist() == [2.0, 8.0]
    assert graphs.before_step(3) is False  # nothing for the loop to capture: the wrapper does


def test_graph_safe_rng_streams_are_saved_as_state_tensors():
    """Under CUDA graphs megatron-core's tracker holds torch.Generators; a checkpoint keeps their state tensors,
    which load into a run with or without graphs (set_rng_state converts them back for a graphed run)."""
    stream = torch.Generator().manual_seed(7)
    saved = tracker_states_as_tensors({"model-parallel-rng": stream, "data-parallel-rng": stream.get_state()})
    expected = torch.Generator().manual_seed(7).get_state()
    assert all(isinstance(s, torch.Tensor) and torch.equal(s, expected) for s in saved.values())
