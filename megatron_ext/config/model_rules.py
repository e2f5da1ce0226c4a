"""The model architecture's config rules: which layers are MoE layers and how their experts are routed and laid out,
multi-latent attention, multi-token prediction, GPT-OSS's attention and GLU. Each broken rule is one ConfigError
naming the key and what to do, before any process starts (called by :func:`megatron_ext.config.validate.validate_layout`)."""

from __future__ import annotations

from typing import Optional

from megatron_ext.config.schema import ModelConfig, RecipeConfig, expert_tensor_parallel_size, recomputed_modules
from megatron_ext.config.shape import ModelShape, moe_layer_pattern
from megatron_ext.errors import require

_UNVERIFIED_WITH_MOE = "is not verified with MoE models here: set it false (docs/moe.md)"
_UNVERIFIED_WITH_MTP = "is not verified with multi-token prediction (model.mtp_num_layers) here yet: set it false"


def validate_moe_layer_freq(m: ModelConfig) -> None:
    """model.moe_layer_freq, before anything reads the model's shape (which resolves it)."""
    freq = m.moe_layer_freq
    if m.num_moe_experts is None:
        require(freq == 1, "model.moe_layer_freq", freq, "says which layers of an MoE model are MoE layers: set "
                "model.num_moe_experts, or leave it 1")
    elif isinstance(freq, int):
        require(freq >= 1, "model.moe_layer_freq", freq, "must be N >= 1 (every N-th layer from the first an MoE "
                "layer) or a 0/1 flag per layer")
    else:
        require(len(freq) == m.num_layers and set(freq) <= {0, 1} and 1 in freq, "model.moe_layer_freq", list(freq),
                f"must be a 0/1 flag for each of the model.num_layers={m.num_layers} layers (1 = MoE), at least one "
                f"of them 1")


def validate_moe(cfg: RecipeConfig, world_size: int) -> None:
    """Mixture-of-Experts: the router's settings, and the expert layout (EP × ETP groups inside the world's
    non-pipeline ranks, as megatron-core's expert process groups are drawn), before megatron-core refuses them."""
    m, p = cfg.model, cfg.parallel
    experts, ep, etp = m.num_moe_experts, p.expert_model_parallel_size, p.expert_tensor_parallel_size
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if experts is None:
        for ok, key, value, does, leave in [
                (ep == 1, "parallel.expert_model_parallel_size", ep, "splits", "leave it 1"),
                (etp is None, "parallel.expert_tensor_parallel_size", etp, "splits", "leave it null"),
                (not p.overlap_moe_expert_parallel_comm, "parallel.overlap_moe_expert_parallel_comm", True,
                 "applies to", "leave it false"),
                (not m.moe_router_force_load_balancing, "model.moe_router_force_load_balancing", True, "applies to",
                 "leave it false"),
                (m.moe_token_dispatcher_type != "flex", "model.moe_token_dispatcher_type", "flex", "applies to",
                 "leave it alltoall")]:
            require(ok, key, value, f"{does} the experts of an MoE model: set model.num_moe_experts, or {leave}")
        return
    etp = expert_tensor_parallel_size(cfg)
    shape = ModelShape.of(m)
    require(experts >= 2, "model.num_moe_experts", experts, "an MoE layer needs at least 2 experts (null = dense)")
    require(1 <= m.moe_router_topk <= experts, "model.moe_router_topk", m.moe_router_topk,
            f"must be in 1..model.num_moe_experts={experts}")
    require(ep >= 1 and experts % ep == 0, "parallel.expert_model_parallel_size", ep,
            f"must divide model.num_moe_experts={experts} (each EP rank holds the same number of experts); valid: "
            f"{[d for d in range(1, experts + 1) if experts % d == 0]}")
    require(etp >= 1 and shape.expert_ffn_hidden_size % etp == 0, "parallel.expert_tensor_parallel_size", etp,
            f"must divide the experts' width {shape.expert_ffn_hidden_size} (model.moe_ffn_hidden_size)")
    require(etp == 1 or not m.add_bias_linear, "parallel.expert_tensor_parallel_size", etp, "experts with biases "
            "(model.add_bias_linear) are never split over TP (megatron-core's rule): set it 1, or null")
    non_pipeline = world_size // pp
    require(non_pipeline % (ep * etp) == 0, "parallel.expert_model_parallel_size", ep,
            f"EP × expert_tensor_parallel_size = {ep}×{etp} = {ep * etp} must divide the {non_pipeline} ranks of each "
            f"pipeline stage (world size {world_size} / PP {pp}): the expert layers regroup those ranks into "
            f"EP×ETP×expert-DP")
    require(tp == 1 or p.sequence_parallel or not needs_sequence_parallel(m), "parallel.sequence_parallel", False,
            "megatron-core's MoE layer trains under tensor parallelism only with sequence parallelism: set it true")
    require(not (m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax),
            "model.moe_router_pre_softmax", False, "top-1 routing with softmax scores needs the softmax over all "
            "experts first (over the one chosen it is always 1, with zero gradient): set it true")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    require((groups is None) == (group_topk is None), "model.moe_router_group_topk", group_topk,
            "group-limited routing needs both model.moe_router_num_groups and moe_router_group_topk (or neither)")
    if groups is not None:
        require(experts % groups == 0, "model.moe_router_num_groups", groups,
                f"must divide model.num_moe_experts={experts} (equal groups)")
        require(group_topk <= groups and group_topk <= m.moe_router_topk and
                m.moe_router_topk <= group_topk * (experts // groups), "model.moe_router_group_topk", group_topk,
                f"must be at most model.moe_router_num_groups={groups} and model.moe_router_topk="
                f"{m.moe_router_topk} (a group is scored by its best topk/group_topk experts), and its groups must "
                f"hold the top-{m.moe_router_topk}")
    require(not m.moe_router_enable_expert_bias or m.moe_router_score_function == "sigmoid",
            "model.moe_router_enable_expert_bias", True, "megatron-core's expert bias works with sigmoid scores: set "
            "model.moe_router_score_function=sigmoid")
    capacity = m.moe_expert_capacity_factor
    require(capacity is not None or not m.moe_pad_expert_input_to_capacity, "model.moe_pad_expert_input_to_capacity",
            True, "pads to the capacity: set model.moe_expert_capacity_factor")
    shared = m.moe_shared_expert_intermediate_size
    require(shared is None or (shared > 0 and shared % tp == 0), "model.moe_shared_expert_intermediate_size", shared,
            f"must be a positive multiple of parallel.tensor_model_parallel_size={tp}, or null")
    require(m.moe_grouped_gemm is not True or m.attention_backend != "local", "model.moe_grouped_gemm", True,
            "the grouped GEMM is TransformerEngine's (TEGroupedMLP): set model.attention_backend=auto or te")
    _validate_flex_dispatcher(cfg)
    _validate_expert_overlap(cfg)
    # combinations no MoE run here has verified yet (Megatron-FSDP: megatron_fsdp_refusal)
    for ok, key, value in [(cfg.train.cuda_graph_impl != "local", "train.cuda_graph_impl", "local"),
                           (not cfg.optimizer.optimizer_cpu_offload, "optimizer.optimizer_cpu_offload", True)]:
        require(ok, key, value, _UNVERIFIED_WITH_MOE)


def _validate_flex_dispatcher(cfg: RecipeConfig) -> None:
    """model.moe_token_dispatcher_type=flex and its backend, as megatron-core checks them (the package and the GPU
    it needs are config/kernels.py's machine rules)."""
    m, p = cfg.model, cfg.parallel
    backend = m.moe_flex_dispatcher_backend
    if m.moe_token_dispatcher_type != "flex":
        require(backend == "deepep", "model.moe_flex_dispatcher_backend", backend, "chooses the flex dispatcher's "
                "kernels: set model.moe_token_dispatcher_type=flex, or leave it deepep")
        return
    if backend == "deepep":
        ep_etp = p.expert_model_parallel_size * expert_tensor_parallel_size(cfg)
        require(ep_etp > 1, "parallel.expert_model_parallel_size", p.expert_model_parallel_size, "DeepEP dispatches "
                "tokens between the ranks of expert_model_parallel_size × expert_tensor_parallel_size, here 1 "
                "(megatron-core's rule): raise one of them, or use model.moe_token_dispatcher_type=alltoall")
        require(not m.moe_pad_expert_input_to_capacity, "model.moe_pad_expert_input_to_capacity", True, "DeepEP's "
                "dispatch does not pad experts' inputs to their capacity (megatron-core's rule): set it false, or "
                "model.moe_flex_dispatcher_backend=hybridep")


def _validate_expert_overlap(cfg: RecipeConfig) -> None:
    """parallel.overlap_moe_expert_parallel_comm: megatron-core's 1F1B schedule that overlaps one micro batch's
    expert all-to-alls with another's compute, and its asserts (TransformerConfig, the schedule plan)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not p.overlap_moe_expert_parallel_comm:
        return
    key = "parallel.overlap_moe_expert_parallel_comm"
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    last_is_moe = moe_layer_pattern(m.moe_layer_freq, m.num_layers)[-1]
    for ok, name, value, why in [
        (p.expert_model_parallel_size > 1, "parallel.expert_model_parallel_size", p.expert_model_parallel_size,
         f"{key} overlaps the all-to-alls of expert parallelism (megatron-core's rule): set it above 1"),
        (m.moe_token_dispatcher_type in ("alltoall", "flex"), "model.moe_token_dispatcher_type",
         m.moe_token_dispatcher_type, f"{key} overlaps all-to-all dispatch (megatron-core's rule): use alltoall or flex"),
        (pp == 1 or vpp is not None, "parallel.virtual_pipeline_model_parallel_size", vpp, f"{key} under pipeline "
         "parallelism pairs the forward and backward of different virtual stages (megatron-core's rule): set it"),
        (t.recompute_granularity != "full", "train.recompute_granularity", "full", f"full recompute does not run "
         f"with {key} (megatron-core's rule): use selective or null"),
        ("moe" not in recomputed_modules(cfg), "train.recompute_modules", list(t.recompute_modules), f"moe recompute "
         f"does not run with {key}, which splits the MoE layer (megatron-core's rule): drop moe"),
        (t.precision in ("bf16", "fp16"), "train.precision", t.precision, f"{key} runs in bf16 or fp16 only "
         "(megatron-core's rule)"),
        (m.mtp_num_layers is None or (m.mtp_num_layers == 1 and last_is_moe), "model.mtp_num_layers",
         m.mtp_num_layers, f"{key} runs at most one multi-token-prediction layer, and an MoE one (the last decoder "
         "layer's kind; megatron-core's rules)"),
        (not t.fused_linear_cross_entropy, "train.fused_linear_cross_entropy", True, f"computes the loss in its own "
         f"output layer, which the schedule of {key} (megatron-core's build_schedule_plan) bypasses: set one false"),
        (not (cfg.data.reset_attention_mask or cfg.data.reset_position_ids), "data.reset_position_ids",
         cfg.data.reset_position_ids, f"document masking under {key} (megatron-core's schedule plan, which bypasses "
         "this model's per-document RoPE) is not verified here: set data.reset_attention_mask and "
         "data.reset_position_ids false"),
    ]:
        require(ok, name, value, why)


def validate_mla(cfg: RecipeConfig) -> None:
    """Multi-latent attention: the keys it replaces, its ranks under TP, and what is not wired with it yet."""
    m, p = cfg.model, cfg.parallel
    if not m.multi_latent_attention:
        return
    tp = p.tensor_model_parallel_size
    for key in ("num_query_groups", "kv_channels"):
        require(getattr(m, key) is None, f"model.{key}", getattr(m, key), "does not apply to multi-latent attention "
                "(each head's keys and values come from the compressed KV; its sizes are model.qk_head_dim, "
                "qk_pos_emb_head_dim, v_head_dim): set it null")
    require(not m.qk_layernorm, "model.qk_layernorm", True, "multi-latent attention has its own norms (over the "
            "compressed query and KV), always on: set it false")
    require(m.qk_pos_emb_head_dim % 2 == 0, "model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim,
            "is rotated in pairs of channels: make it even")
    for key, size in (("q_lora_rank", m.q_lora_rank), ("kv_lora_rank", m.kv_lora_rank + m.qk_pos_emb_head_dim)):
        require(size % tp == 0, f"model.{key}", getattr(m, key), f"the {key.split('_')[0]} "
                f"down-projection's {size} outputs are split over parallel.tensor_model_parallel_size={tp}: make them "
                "a multiple of it" + (" (with model.qk_pos_emb_head_dim)" if key == "kv_lora_rank" else ""))
    require(m.rope_scaling_factor is None, "model.rope_scaling_factor", m.rope_scaling_factor,
            "(Llama 3.1's RoPE scaling) does not apply to multi-latent attention, whose long-context scaling is YaRN: "
            "set it null (and model.rope_type=yarn with model.rotary_scaling_factor)")
    require(m.correction_range_round_to_int, "model.correction_range_round_to_int", False, "megatron-core's "
            "multi-latent attention always rounds YaRN's frequency band to whole channels: set it true")
    for key in ("softmax_type", "window_size"):
        require(getattr(m, key) == getattr(ModelConfig, key), f"model.{key}", getattr(m, key), "is not wired with "
                f"multi-latent attention here: leave it {getattr(ModelConfig, key)}")
    require(not cfg.data.reset_position_ids, "data.reset_position_ids", True, "megatron-core's multi-latent "
            "attention numbers positions 0..seq_length-1 itself and cannot restart them at documents: set it false "
            "(data.reset_attention_mask still keeps attention within each document)")


def needs_sequence_parallel(m: ModelConfig) -> bool:
    """Whether model `m` trains under tensor parallelism only with sequence parallelism (megatron-core's MoE layer);
    the planner searches no other layout for it."""
    return m.num_moe_experts is not None


def megatron_fsdp_refusal(m: ModelConfig) -> Optional[str]:
    """Why parallel.use_megatron_fsdp is refused for model `m` whatever the layout (what no run here has verified
    it with), or None. The planner leaves ZeRO-2/3 out of its search on it."""
    if m.num_moe_experts is not None:
        return _UNVERIFIED_WITH_MOE
    if m.mtp_num_layers is not None:
        return _UNVERIFIED_WITH_MTP
    return None


def validate_megatron_fsdp_model(cfg: RecipeConfig) -> None:
    """parallel.use_megatron_fsdp against the model (:func:`megatron_fsdp_refusal`)."""
    why = megatron_fsdp_refusal(cfg.model)
    require(not cfg.parallel.use_megatron_fsdp or why is None, "parallel.use_megatron_fsdp", True, why or "")


def validate_mtp(cfg: RecipeConfig) -> None:
    """Multi-token prediction: what it is verified with here (its layers sit on the last pipeline stage, in its last
    virtual stage: megatron-core's default placement)."""
    m, t = cfg.model, cfg.train
    if m.mtp_num_layers is None:
        return
    require(m.untie_embeddings_and_output_weights, "model.untie_embeddings_and_output_weights", False,
            "multi-token prediction is verified here with an output layer of its own (DeepSeek-V3's): set it true")
    require(not t.fused_linear_cross_entropy, "train.fused_linear_cross_entropy", True, "computes the main loss only; "
            "multi-token prediction's losses need megatron-core's output layer: set it false")
    for ok, key in [(not cfg.data.reset_attention_mask, "data.reset_attention_mask"),
                    (not cfg.data.reset_position_ids, "data.reset_position_ids")]:
        require(ok, key, True, _UNVERIFIED_WITH_MTP)


def validate_model_class(cfg: RecipeConfig) -> None:
    """What megatron-core's HybridModel (model.model_class=hybrid) is not built with here yet, each refused in one
    line; the rest trains as GPTModel does (the parity runs of tests/integration/test_hybrid.py)."""
    m, t = cfg.model, cfg.train
    if m.model_class != "hybrid":
        return
    later = "with model.model_class=hybrid is not wired here yet (issue #61): set model.model_class=gpt"
    for ok, key, value, why in [
        (t.cpu_offloading_num_layers == 0, "train.cpu_offloading_num_layers", t.cpu_offloading_num_layers,
         "megatron-core's HybridStack has no layer offload (train.offload_modules offloads within layers): set it 0"),
        (t.cuda_graph_impl == "none", "train.cuda_graph_impl", t.cuda_graph_impl,
         f"(CUDA graphs of HybridModel's layers, unmeasured on a GPU) {later}"),
    ]:
        require(ok, key, value, why)


def validate_attention_and_glu(cfg: RecipeConfig) -> None:
    """GPT-OSS's pieces — attention sinks, sliding windows, biases, the clamped quick-GeGLU — and YaRN: their shapes,
    and what they are not wired with here (context parallelism's ring attention, the fused SwiGLU kernels, RoPE
    restarted at documents), each refused in one line."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.rope_type == "yarn":
        require(m.beta_fast >= m.beta_slow, "model.beta_fast", m.beta_fast, f"must be at least model.beta_slow="
                f"{m.beta_slow:g} (YaRN interpolates the frequencies between the two; Kimi K2: both 1)")
        require(m.rope_scaling_factor is None, "model.rope_scaling_factor", m.rope_scaling_factor, "(Llama 3.1's "
                "RoPE scaling) and YaRN (model.rope_type=yarn) are two long-context scalings: keep one")
        require(m.multi_latent_attention or not cfg.data.reset_position_ids, "data.reset_position_ids", True,
                "megatron-core's YaRN embedding numbers positions 0..seq_length-1 and this model cannot restart it at "
                "documents: set it false (data.reset_attention_mask still keeps attention within each document)")
    window = m.window_size
    if window is None:
        require(m.window_attn_skip_freq is None, "model.window_attn_skip_freq", m.window_attn_skip_freq,
                "chooses which layers keep a sliding window: set model.window_size, or leave it null")
    else:
        require(len(window) == 2 and window[0] >= 1 and window[1] == 0, "model.window_size", list(window),
                "must be [left, 0]: each query sees the left >= 1 keys before it and itself (causal; Hugging Face's "
                "sliding_window=W is [W-1, 0])")
        skip = m.window_attn_skip_freq
        require(skip is None or (isinstance(skip, int) and skip >= 2) or (
            isinstance(skip, list) and len(skip) == m.num_layers and set(skip) <= {0, 1}),
            "model.window_attn_skip_freq", skip, f"must be N >= 2 (every N-th layer full, the others windowed), a 0/1 "
            f"flag for each of the model.num_layers={m.num_layers} layers (1 = windowed), or null (all windowed)")
    if m.softmax_type != "vanilla" or window is not None:
        what = "attention sinks (model.softmax_type)" if m.softmax_type != "vanilla" else "sliding window"
        require(p.context_parallel_size == 1, "parallel.context_parallel_size", p.context_parallel_size,
                f"the ring attention that splits sequences over CP ranks here has no {what}: set it 1")
    plain_glu = m.activation_func == "silu" and m.activation_func_clamp_value is None and m.glu_linear_offset == 0.0
    for key in ("fused_swiglu", "liger_kernels"):
        require(plain_glu or not getattr(t, key), f"train.{key}", True, "fuses the plain SwiGLU; this model's GLU "
                "(model.activation_func, activation_func_clamp_value, glu_linear_offset) runs unfused: set it false")
