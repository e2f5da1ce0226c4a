"""Mixture-of-Experts pieces that need no processes: the layout and router rules refused before launch (one line
each), the parameter counts of published MoE shapes, the grouped GEMM's `auto`, and the routers' load statistics and
collapse warning (the model-level proofs are in tests/integration/test_moe.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.config.kernels import resolve_kernel_options
from megatron_ext.config.schema import load_config
from megatron_ext.config.shape import ModelShape
from megatron_ext.config.validate import validate_layout
from megatron_ext.errors import ConfigError
from megatron_ext.metrics.moe_metrics import CollapseDetector, collapse_remedy, load_statistics
from tests.launch import ROOT

TINY_MOE = ROOT / "configs" / "tiny_moe.yaml"  # 8 experts, EP2 × PP2 on 4 ranks
ANY_DP = ["train.micro_batch_size=1", "train.global_batch_size=48"]  # a global batch DP 3 and 6 divide


@pytest.mark.parametrize("overrides, world, fragment", [
    (["parallel.expert_model_parallel_size=3", *ANY_DP], 6, "must divide model.num_moe_experts=8 (each EP rank holds"),
    (["parallel.expert_model_parallel_size=4"], 4, "EP × expert_tensor_parallel_size = 4×1 = 4 must divide the 2 "
     "ranks of each pipeline stage"),
    (["parallel.expert_tensor_parallel_size=3", *ANY_DP], 12, "must divide the experts' width 256"),
    (["model.moe_router_topk=9"], 4, "must be in 1..model.num_moe_experts=8"),
    (["model.num_moe_experts=1", "parallel.expert_model_parallel_size=1"], 4, "at least 2 experts"),
    (["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=1"], 4,
     "parallel.sequence_parallel=False is invalid: megatron-core's MoE layer trains under tensor parallelism"),
    (["model.moe_router_topk=1"], 4, "top-1 routing with softmax scores needs the softmax over all experts first"),
    (["model.moe_router_enable_expert_bias=true"], 4, "set model.moe_router_score_function=sigmoid"),
    (["model.moe_pad_expert_input_to_capacity=true"], 4, "set model.moe_expert_capacity_factor"),
    (["model.moe_grouped_gemm=true", "model.attention_backend=local"], 4, "TransformerEngine's (TEGroupedMLP)"),
    (["parallel.use_megatron_fsdp=true", "parallel.pipeline_model_parallel_size=1"], 4,
     "parallel.use_megatron_fsdp=True is invalid: is not verified with MoE models here"),
    (["model.num_moe_experts=null"], 4, "parallel.expert_model_parallel_size=2 is invalid: splits the experts of an "
     "MoE model"),
])
def test_moe_layouts_and_routers_megatron_core_would_refuse_are_one_line_before_launch(overrides, world, fragment):
    cfg = load_config(TINY_MOE, overrides)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("×", "×")):
        validate_layout(cfg, world)


def test_the_tiny_moe_recipe_and_its_variants_are_valid():
    validate_layout(load_config(TINY_MOE), 4)
    # EP × ETP regroup each stage's ranks: TP2+SP with ETP1 × EP2 (expert-DP 1) on 2 ranks per stage
    validate_layout(load_config(TINY_MOE, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                                           "parallel.expert_tensor_parallel_size=1"]), 8)
    validate_layout(load_config(TINY_MOE, ["model.moe_router_topk=1", "model.moe_router_pre_softmax=true",
                                           "model.moe_router_score_function=sigmoid",
                                           "model.moe_router_enable_expert_bias=true",
                                           "model.moe_router_load_balancing_type=none"]), 4)


@pytest.mark.parametrize("shape, total, active", [
    # Mixtral-8x7B: 46.7B parameters, 12.9B active (Mistral AI's model card)
    (dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
          num_moe_experts=8, moe_router_topk=2), 46_702_792_704, 12_879_925_248),
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active (Qwen's model card; its per-head q/k norms, 2·128 per layer, are
    # not counted here)
    (dict(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
          ffn_hidden_size=6144, moe_ffn_hidden_size=768, num_moe_experts=128, moe_router_topk=8),
     30_532_110_336, 3_353_020_416),
])
def test_moe_parameter_counts_match_the_published_shapes(shape, total, active):
    vocab = 32000 if shape["num_moe_experts"] == 8 else 151936
    model = ModelShape.of(shape)
    assert model.num_parameters(vocab) == total
    assert model.num_parameters(vocab, active=True) == active
    # training FLOPs follow the active parameters: 6 per parameter a token goes through (plus attention)
    assert model.flops_per_token(vocab) < 6.5 * active


def test_grouped_gemm_auto_is_on_in_transformer_engines_layers_only():
    cfg = load_config(TINY_MOE)
    assert resolve_kernel_options(cfg, on_gpu=True, use_te=True).model.moe_grouped_gemm is True
    assert resolve_kernel_options(cfg, on_gpu=False, use_te=False).model.moe_grouped_gemm is False
    dense = load_config(ROOT / "configs" / "tiny.yaml")
    assert resolve_kernel_options(dense, on_gpu=True, use_te=True).model.moe_grouped_gemm is False
    with pytest.raises(ConfigError, match="this machine builds megatron-core's local layers: set it auto"):
        resolve_kernel_options(load_config(TINY_MOE, ["model.moe_grouped_gemm=true"]), on_gpu=False, use_te=False)


def test_load_statistics_per_layer():
    # layer 1: 8 tokens, top-2 over 4 experts, evenly (4 each); layer 2: expert 0 on every token, 2 slots dropped
    counts = torch.tensor([[4, 4, 4, 4], [8, 3, 3, 0]])
    stats = load_statistics(counts, torch.tensor([8, 8]), topk=2)
    assert stats["max_load"].tolist() == [0.5, 1.0] and stats["min_load"].tolist() == [0.5, 0.0]
    spread = counts[1].double().std(unbiased=False) / 3.5
    assert stats["load_cv"][0] == 0 and stats["load_cv"][1] == pytest.approx(spread)
    assert stats["dropped"].tolist() == [0.0, 0.125]


def test_routing_collapse_is_warned_once_after_the_set_number_of_intervals_and_again_after_a_recovery():
    detector = CollapseDetector(share=0.5, intervals=3, remedy="raise it")
    loads = [0.9, 0.9, 0.9, 0.9, 0.3, 0.9, 0.9, 0.9]
    warned = [detector.update({3: load, 1: 0.25}, {3: 5, 1: 0}, even=0.25) for load in loads]
    assert [len(w) for w in warned] == [0, 0, 1, 0, 0, 0, 0, 1]
    assert warned[2][0].startswith("routing collapse in MoE layer 3: expert 5 took 90% of the layer's tokens, above "
                                   "logging.moe_collapse_share=0.5, for 3 log intervals in a row (an even split gives "
                                   "each expert 25.0%): raise it")
    assert CollapseDetector(share=None, intervals=3, remedy="").update({1: 1.0}, {1: 0}, even=0.25) == []


@pytest.mark.parametrize("overrides, remedy", [
    ([], "raise model.moe_aux_loss_coeff, or lower the learning rate"),
    (["model.moe_router_load_balancing_type=none"], "balance the load: model.moe_router_load_balancing_type=aux_loss"),
    (["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true"],
     "raise model.moe_router_bias_update_rate (the expert bias's step)"),
])
def test_the_collapse_remedy_is_one_the_model_does_not_already_use(overrides, remedy):
    assert collapse_remedy(load_config(TINY_MOE, overrides).model).startswith(remedy)


def test_a_checkpoint_with_the_earlier_pre_mlp_norm_key_loads(monkeypatch, tmp_path):
    """Local MoE checkpoints saved the pre-MLP norm under the dense fused-norm key before it moved to TE's: the model's
    and the optimizer's requests for it are pointed there when (only when) the checkpoint has the earlier name."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ext.checkpoint import compat

    def requests() -> dict:
        return {"model": {"norm": ShardedTensor.from_rank_offsets("decoder.layers.pre_mlp_layernorm.weight",
                                                                  torch.ones(4)),
                          "extra": ShardedTensor.from_rank_offsets("decoder.layers.pre_mlp_layernorm._extra_state",
                                                                   torch.ones(1))},
                "optimizer": {"moment": ShardedTensor.from_rank_offsets(
                    "optimizer.state.exp_avg.decoder.layers.pre_mlp_layernorm.weight", torch.ones(4))}}

    def keys(state: dict) -> list[str]:
        return [state["model"]["norm"].key, state["model"]["extra"].key, state["optimizer"]["moment"].key]

    earlier = ["decoder.layers.mlp.linear_fc1.layer_norm_weight",
               "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.layer_norm_weight"]
    for saved, expected in [(earlier, [earlier[0], "decoder.layers.pre_mlp_layernorm._extra_state", earlier[1]]),
                            (keys(requests()), keys(requests()))]:
        monkeypatch.setattr(compat.dist_checkpointing, "load_tensors_metadata", lambda _: dict.fromkeys(saved))
        state = requests()
        compat._load_legacy_keys(state, tmp_path)
        assert keys(state) == expected


def test_resuming_into_another_moe_shape_is_refused_by_every_key_that_changes_a_parameter():
    """The resume check reads ModelShape's parameter-shape settings: the expert count, the experts' and the shared
    experts' widths and the q/k norms are refused like a dense width; top-k and the sequence length are not."""
    from megatron_ext.checkpoint.resume import shape_changes

    saved = load_config(ROOT / "configs" / "tiny_moe.yaml").to_dict()
    for key, value, expected in [("num_moe_experts", 4, "model.num_moe_experts: 8 → 4"),
                                 ("moe_ffn_hidden_size", 128, "model.moe_ffn_hidden_size: 256 → 128"),
                                 ("moe_shared_expert_intermediate_size", 256,
                                  "model.moe_shared_expert_intermediate_size: 0 → 256"),
                                 ("qk_layernorm", True, "model.qk_layernorm: False → True")]:
        current = {**saved, "model": {**saved["model"], key: value}}
        assert shape_changes(saved, current) == [expected], key
    for key, value in [("moe_router_topk", 1), ("seq_length", 64)]:
        assert shape_changes(saved, {**saved, "model": {**saved["model"], key: value}}) == [], key


# ---------------------------------------------------------------------------------------------------------------------
# the flex dispatcher, forced load balancing and the overlapped expert all-to-alls

def _moe_config(overrides: list[str], use_te: bool = True):
    from megatron_ext.model.llama import transformer_config

    return transformer_config(load_config(TINY_MOE, overrides), on_gpu=False, use_te=use_te)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_the_flex_dispatcher_and_its_backend_reach_megatron_core(backend, monkeypatch):
    from megatron.core.transformer.moe import fused_a2a

    from megatron_ext.config.kernels import refuse_what_this_machine_cannot_run

    flex = ["model.moe_token_dispatcher_type=flex", f"model.moe_flex_dispatcher_backend={backend}"]
    validate_layout(load_config(TINY_MOE, flex), 4)
    monkeypatch.setattr(fused_a2a, "HAVE_DEEP_EP" if backend == "deepep" else "HAVE_HYBRIDEP", True)
    refuse_what_this_machine_cannot_run(load_config(TINY_MOE, flex), on_gpu=True, te_available=True)
    config = _moe_config(flex)
    assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == ("flex", backend)


@pytest.mark.parametrize("backend, missing", [("deepep", "HAVE_DEEP_EP"), ("hybridep", "HAVE_HYBRIDEP")])
def test_the_flex_dispatcher_needs_a_gpu_and_its_package(backend, missing, monkeypatch):
    from megatron.core.transformer.moe import fused_a2a

    from megatron_ext.config.kernels import refuse_what_this_machine_cannot_run

    cfg = load_config(TINY_MOE, ["model.moe_token_dispatcher_type=flex", f"model.moe_flex_dispatcher_backend={backend}"])
    with pytest.raises(ConfigError, match=rf"^model.moe_token_dispatcher_type='flex' is invalid: {backend}'s fused "
                                          r"dispatch kernels need GPUs .* a CPU rehearsal routes with "
                                          r"model.moe_token_dispatcher_type=alltoall — set it there$"):
        refuse_what_this_machine_cannot_run(cfg, on_gpu=False, te_available=False)
    monkeypatch.setattr(fused_a2a, missing, False)
    with pytest.raises(ConfigError, match=rf"model.moe_flex_dispatcher_backend='{backend}' is invalid: .* is not "
                                          r"installed here"):
        refuse_what_this_machine_cannot_run(cfg, on_gpu=True, te_available=True)


@pytest.mark.parametrize("overrides, fragment", [
    (["model.moe_token_dispatcher_type=flex", "parallel.expert_model_parallel_size=1"], "DeepEP dispatches tokens "
     "between the ranks of expert_model_parallel_size × expert_tensor_parallel_size, here 1"),
    (["model.moe_token_dispatcher_type=flex", "model.moe_expert_capacity_factor=1.0",
      "model.moe_pad_expert_input_to_capacity=true"], "DeepEP's dispatch does not pad experts' inputs"),
    (["model.moe_flex_dispatcher_backend=hybridep"], "chooses the flex dispatcher's kernels: set "
     "model.moe_token_dispatcher_type=flex"),
    (["model.num_moe_experts=null", "parallel.expert_model_parallel_size=1", "model.moe_token_dispatcher_type=flex"],
     "model.moe_token_dispatcher_type='flex' is invalid: applies to the experts of an MoE model"),
    (["model.num_moe_experts=null", "parallel.expert_model_parallel_size=1",
      "model.moe_router_force_load_balancing=true"], "model.moe_router_force_load_balancing=True is invalid: applies "
     "to the experts of an MoE model"),
])
def test_flex_and_forced_balancing_rules_are_one_line_before_launch(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate_layout(load_config(TINY_MOE, overrides), 4)


def test_forced_load_balancing_reaches_megatron_core_and_the_start_up_line():
    """Benchmark mode: megatron-core's router scores every token randomly (it runs in CPU rehearsal too:
    tests/integration/test_moe.py)."""
    forced = ["model.moe_router_force_load_balancing=true"]
    validate_layout(load_config(TINY_MOE, forced), 4)
    assert _moe_config(forced, use_te=False).moe_router_force_load_balancing is True
    assert _moe_config([], use_te=False).moe_router_force_load_balancing is False


A2A = ["parallel.overlap_moe_expert_parallel_comm=true", "train.precision=bf16",
       "parallel.virtual_pipeline_model_parallel_size=2"]  # EP2 × PP2: interleaved stages


def test_the_overlapped_expert_all_to_alls_reach_megatron_core_and_need_a_gpu():
    from megatron_ext.config.kernels import refuse_what_this_machine_cannot_run

    cfg = load_config(TINY_MOE, [*A2A, "train.global_batch_size=32"])
    validate_layout(cfg, 4)
    assert _moe_config([*A2A, "train.global_batch_size=32"]).overlap_moe_expert_parallel_comm is True
    refuse_what_this_machine_cannot_run(cfg, on_gpu=True, te_available=True)
    with pytest.raises(ConfigError, match=r"^parallel.overlap_moe_expert_parallel_comm=True is invalid: megatron-core's "
                                          r"overlapped schedule runs the expert all-to-alls on a second CUDA stream; a "
                                          r"CPU rehearsal has none — set it false there$"):
        refuse_what_this_machine_cannot_run(cfg, on_gpu=False, te_available=False)


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.virtual_pipeline_model_parallel_size=null"], "parallel.virtual_pipeline_model_parallel_size=None is "
     "invalid: parallel.overlap_moe_expert_parallel_comm under pipeline parallelism pairs"),
    (["parallel.expert_model_parallel_size=1"], "parallel.expert_model_parallel_size=1 is invalid: "
     "parallel.overlap_moe_expert_parallel_comm overlaps the all-to-alls of expert parallelism"),
    (["model.moe_token_dispatcher_type=allgather"], "model.moe_token_dispatcher_type='allgather' is invalid: "
     "parallel.overlap_moe_expert_parallel_comm overlaps all-to-all dispatch"),
    (["train.recompute_granularity=full"], "full recompute does not run with"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[moe]"], "moe recompute does not run with"),
    (["train.precision=fp32"], "runs in bf16 or fp16 only"),
    (["model.mtp_num_layers=2"], "model.mtp_num_layers=2 is invalid"),
    (["train.fused_linear_cross_entropy=true"], "computes the loss in its own output layer"),
    (["data.reset_position_ids=true"], "document masking under parallel.overlap_moe_expert_parallel_comm"),
    (["model.num_moe_experts=null", "parallel.expert_model_parallel_size=1"],
     "parallel.overlap_moe_expert_parallel_comm=True is invalid: applies to the experts of an MoE model"),
])
def test_what_megatron_core_refuses_with_overlapped_all_to_alls_is_one_line(overrides, fragment):
    cfg = load_config(TINY_MOE, [*A2A, "train.global_batch_size=32", *overrides])
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate_layout(cfg, 4)


def test_the_overlapped_schedule_gets_the_micro_batchs_schedule_plan_from_the_forward_step(monkeypatch):
    """megatron-core's combined 1F1B schedule calls the forward step with return_schedule_plan=True: the model then
    builds the micro batch's plan (GPTModel.build_schedule_plan) from the same inputs its forward takes."""
    from megatron.core import parallel_state

    from megatron_ext.training import micro_batch

    monkeypatch.setattr(micro_batch, "device", lambda: torch.device("cpu"))
    monkeypatch.setattr(micro_batch, "get_batch_on_this_cp_rank", lambda batch, **_: batch)
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: None)
    calls = []

    class Model:
        def __call__(self, *args, **kwargs):
            calls.append(("forward", args, kwargs))
            return "output"

        def build_schedule_plan(self, *args, **kwargs):
            calls.append(("plan", args, kwargs))
            return "plan"

    batch = {"tokens": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None],
             "labels": torch.ones(1, 4, dtype=torch.long), "loss_mask": torch.ones(1, 4)}
    assert micro_batch.forward_step(iter([batch]), Model())[0] == "output"
    assert micro_batch.forward_step(iter([batch]), Model(), return_schedule_plan=True)[0] == "plan"
    (_, forward_args, forward_kwargs), (_, plan_args, plan_kwargs) = calls
    assert [a.tolist() for a in forward_args] == [a.tolist() for a in plan_args] and forward_kwargs.keys() == \
        plan_kwargs.keys() == {"attention_mask", "labels", "loss_mask", "packed_seq_params"}
