"""The recipe config's schema: every section and key with its type, default and help, and loading a YAML recipe
plus ``section.key=value`` overrides into it.

Field names follow megatron-core's own (``TransformerConfig``, ``OptimizerConfig``, parallel_state). Enum-like
keys are ``Literal`` types, so OmegaConf rejects a value outside them when the config loads, naming the allowed
ones. The comment on (or directly above) each field is its help: ``python -m recipes.pretrain --list-keys`` prints
it, and docs/config-keys.md is that output. Cross-field rules live in :mod:`megatron_ext.config.validate`.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import io
import tokenize
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union, get_args

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_ext.config.ranges import AUTO_NUMBER_KEYS, check_ranges
from megatron_ext.config.values import checked_values, override_as_config
from megatron_ext.errors import ConfigError

AUTO = "auto"  # a kernel option decided for the machine it runs on (config.kernels.resolve_kernel_options)
AutoBool = Literal[True, False, "auto"]
# A number, or "auto": derived from the planned step and save times at launch (megatron_ext.planner.timeouts); the
# config loader refuses any other string (OmegaConf takes no Literal inside a Union)
AutoNumber = Union[int, float, str, None]
# What an unresolved "auto" timeout means where no launch planned it (a Trainer built directly, as in a benchmark):
# the floors the plan never goes below — torch's default collective timeout and five minutes of silence
HANG_TIMEOUT_FLOOR_S = 300.0
HANG_MARGIN = 2.0  # a silence this many times the longest planned (or seen) stretch between finished steps is a hang
COLLECTIVE_TIMEOUT_FLOOR_MINUTES = 10
AttentionBackend = Literal["auto", "te", "local"]
ModelClass = Literal["gpt", "hybrid"]  # megatron-core's GPTModel, or its successor HybridModel (model/hybrid.py)
TEAttentionKernel = Literal["auto", "flash", "fused", "unfused"]  # megatron-core's AttnBackend, TE's kernel
Precision = Literal["fp32", "bf16", "fp16"]
ShardingStrategy = Literal["optim", "optim_grads", "optim_grads_params"]  # megatron-core's ZeRO-1/2/3 names
ZERO_LEVEL: dict[str, int] = {"optim": 1, "optim_grads": 2, "optim_grads_params": 3}
OuterShardingStrategy = Literal["no_shard", "optim"]  # Megatron-FSDP's HSDP: across its replicas
# TransformerEngine's FP8 scaling recipes as megatron-core names them: delayed (amax history), tensorwise (current
# per-tensor scaling), blockwise (128-element blocks, DeepSeek-V3's; Hopper or newer), mxfp8 (32-element E8M0 blocks;
# Blackwell). The GPUs each runs on: config/validate.py (LOW_PRECISION_GPUS)
FP8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
FP4Recipe = Literal["nvfp4"]  # TransformerEngine's NVFP4 (E2M1 with 16-element E4M3 scales; Blackwell)
RecomputeGranularity = Literal["selective", "full"]
# megatron-core's selective-recompute modules (TransformerConfig.recompute_modules)
RecomputeModule = Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]
# megatron-core's CUDA-graph implementations: per layer (its own, or TransformerEngine's make_graphed_callables),
# or the whole forward-backward of a step as one graph
CudaGraphImpl = Literal["none", "local", "transformer_engine", "full_iteration"]
CudaGraphModule = Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess"]  # per-layer graphs' capture regions
# The dense layer's inputs megatron-core's fine-grained activation offload can move to host memory (attn_proj needs
# core_attn: its input is core attention's output, which core attention's backward still reads)
OffloadModule = Literal["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
# Mixture-of-Experts (megatron-core's TransformerConfig names and values)
MoELoadBalancing = Literal["aux_loss", "seq_aux_loss", "none"]
MoEScoreFunction = Literal["softmax", "sigmoid"]
RopeType = Literal["rope", "yarn"]  # megatron-core's rotary embeddings: plain, or YaRN's long-context scaling
# megatron-core's softmax_type: vanilla; learnable = attention sinks (a learned logit per head that takes part in the
# softmax and attends to nothing: GPT-OSS); off-by-one = that logit fixed at 0
SoftmaxType = Literal["vanilla", "off-by-one", "learnable"]
# the GLU's activation on its gate half: silu (SwiGLU: Llama, Qwen, DeepSeek) or quick_gelu (x·sigmoid(1.702·x): with
# activation_func_clamp_value and glu_linear_offset, GPT-OSS's clamped SwiGLU)
ActivationFunc = Literal["silu", "quick_gelu"]
# the model keys that set YaRN (model.rope_type=yarn), named as megatron-core's MLATransformerConfig fields
YARN_KEYS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim")
MoETokenDispatcher = Literal["alltoall", "allgather", "flex"]
MoEFlexBackend = Literal["deepep", "hybridep"]  # the flex dispatcher's kernels: DeepEP, or HybridEP (NVLink domains)
MoETokenDropPolicy = Literal["probs", "position"]
OptimizerName = Literal["adam", "muon"]  # megatron-core's names; muon: Muon on the hidden matrices, Adam on the rest
MuonScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]  # emerging-optimizers' update scale rules
MatmulPrecision = Literal["highest", "high", "medium"]  # torch.set_float32_matmul_precision's levels
MuonTPMode = Literal["blockwise", "duplicated", "distributed"]  # how Newton-Schulz meets a TP-split matrix
LRDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WSDDecayStyle = Literal["linear", "cosine", "exponential", "minus_sqrt"]  # megatron-core's WSD anneal shapes
TokenizerType = Literal["GPTSentencePieceTokenizer", "HuggingFaceTokenizer"]  # Megatron-LM's type names
# How the distributed optimizer's state is written: megatron-core's formats (DistributedOptimizer.sharded_state_dict).
# fully_reshardable: each TP×PP shard's state all-gathered over DP into every rank's host memory, loadable under any
# layout; *_mem_efficient: the same files, gathered over gloo onto DP rank 0 only; dp_reshardable: each rank writes
# its own slice, no gather, loadable under another DP size only. auto: dp_reshardable, but the checkpoint at
# train.train_iters (the finished run, the one handed on) fully_reshardable_mem_efficient. Measured in
# docs/performance.md ("Checkpoint format"). (megatron-core's fourth, fully_sharded_model_space, fails to save in
# 0.19.2: "ShardedTensor.flattened_range is not supported".)
OptimizerFormat = Literal["auto", "dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient"]
OPTIMIZER_FORMATS: tuple[str, ...] = get_args(OptimizerFormat)
# What a loss spike does (megatron_ext/resilience/spikes.py): nothing, a warning, the step skipped before its update,
# or the run rewound to its newest checkpoint with the data advanced past the spike
SpikePolicy = Literal["off", "warn", "skip", "rewind"]
RerunModeName = Literal["disabled", "validate_results", "report_determinism_stats"]  # megatron-core's RerunMode
RecurringFault = Literal["policies", "rerun_elsewhere"]
# Keys of earlier versions: a config naming one gets a line pointing at its successor; configs saved inside older
# checkpoints drop them when read back (recipes.convert)
RETIRED_KEYS = {
    "logging.loss_spike_factor": "train.spike_threshold (now in median absolute deviations above the median)",
    "logging.loss_spike_window": "train.spike_window",
    "train.cuda_graphs": "train.cuda_graph_impl=local",
}


@dataclass
class RecipeMeta:
    name: str = "unnamed"  # names the run: runs/<name>/ holds its logs unless logging.log_dir says otherwise
    description: str = ""  # one line on what the recipe trains
    gpus: Optional[int] = None  # the GPU count this recipe's layout is written for
    published_params: Optional[int] = None  # parameter count published for this model shape


@dataclass
class ModelConfig:
    num_layers: int = 4  # decoder layers
    hidden_size: int = 256  # model width
    num_attention_heads: int = 8  # query heads
    num_query_groups: Optional[int] = None  # key/value heads (GQA); null = one per query head (MHA)
    ffn_hidden_size: Optional[int] = None  # SwiGLU width; null = Llama's 8/3·h rounded up to a multiple of 256
    kv_channels: Optional[int] = None  # head dimension; null = hidden_size / num_attention_heads
    qk_layernorm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    # QK-clip (MuonClip, Kimi K2): after each optimizer step, the query and key weights of every head whose largest
    # attention logit in the step exceeded qk_clip_threshold are scaled down to bring it to the threshold (the query
    # side by eta^alpha, the key side by eta^(1-alpha)); megatron-core's TransformerConfig names
    qk_clip: bool = False
    qk_clip_threshold: float = 100.0  # the largest pre-softmax logit a head may keep
    qk_clip_alpha: float = 0.5  # the share of the scaling on the query side
    seq_length: int = 256  # tokens per sample
    vocab_size: Optional[int] = None  # unpadded vocabulary; null = the tokenizer's vocabulary size
    make_vocab_size_divisible_by: int = 128  # padded vocab is a multiple of this × TP
    rotary_base: float = 10000.0  # RoPE theta
    rope_scaling_factor: Optional[float] = None  # Llama-3.1-style long-context RoPE scaling (e.g. 8.0, 32.0)
    layernorm_epsilon: float = 1e-5  # RMSNorm epsilon
    init_method_std: float = 0.02  # std of the normal weight initialisation
    # dropout on the attention and MLP outputs (Llama pretraining uses none; the planner counts no dropout masks)
    hidden_dropout: float = 0.0
    # dropout on the attention probabilities (local layers: not with ring attention, CP > 1, nor document masking)
    attention_dropout: float = 0.0
    untie_embeddings_and_output_weights: bool = True  # false = the output layer shares the embedding's weights
    # megatron-core's model class: gpt = GPTModel; hybrid = HybridModel (megatron-core's successor to GPTModel): each
    # decoder layer becomes an attention and an MLP position of its layer pattern, the same computation, and reads
    # GPTModel checkpoints. Transitional (issue #61): hybrid becomes the only class once every suite passes on it
    model_class: ModelClass = "gpt"
    # auto: TransformerEngine when importable; te; local: megatron-core's local layers (SDPA; ring attention
    # under CP)
    attention_backend: AttentionBackend = "auto"
    # TE's attention kernel under its layer spec: auto (TE picks; cuDNN fused where it runs); flash; fused (cuDNN);
    # unfused (plain PyTorch) — the way around a cuDNN that the TE build does not match. Not NVTE_*_ATTN variables:
    # megatron-core refuses those unless they agree with this key
    te_attention_kernel: TEAttentionKernel = "auto"
    # attention sinks (GPT-OSS: learnable), megatron-core's softmax_type (the SoftmaxType comment above)
    softmax_type: SoftmaxType = "vanilla"
    # sliding-window attention, megatron-core's window_size [left, right]: a query sees the `left` keys before it and
    # itself (right must be 0: causal); null = full causal attention. Hugging Face's sliding_window=W is [W-1, 0]
    window_size: Optional[list[int]] = None
    # with window_size, which layers are windowed (megatron-core's window_attn_skip_freq): N = all but every N-th
    # layer counting from 1 (GPT-OSS: 2, windowed and full alternating from a windowed first layer), or a 1/0 flag per
    # layer (1 = windowed); null = every layer windowed
    window_attn_skip_freq: Optional[Union[int, list[int]]] = None
    add_bias_linear: bool = False  # a bias in every linear layer: attention's projections, MLPs, experts, router
    add_qkv_bias: bool = False  # a bias in the query/key/value projection (Qwen2's); implied by add_bias_linear
    activation_func: ActivationFunc = "silu"  # the GLU's activation (the ActivationFunc comment above)
    # the GLU's gate half clamped above at this value and its linear half to ±this before the product; null = none
    # (GPT-OSS: 7)
    activation_func_clamp_value: Optional[float] = None
    glu_linear_offset: float = 0.0  # added to the GLU's linear half before the product (GPT-OSS: 1)
    # Multi-latent attention (DeepSeek-V2/V3, docs/moe.md): queries and keys/values through low-rank projections
    # (each followed by an RMSNorm), every head's query and key a non-rotary part and a rotary part shared by the
    # heads' keys; replaces num_query_groups/kv_channels/qk_layernorm
    multi_latent_attention: bool = False
    q_lora_rank: int = 1536  # rank of the query's down-projection (DeepSeek-V3, Kimi K2: 1536)
    kv_lora_rank: int = 512  # rank of the key/value down-projection: the compressed KV (DeepSeek-V3, Kimi K2: 512)
    qk_head_dim: int = 128  # each head's non-rotary query/key channels
    qk_pos_emb_head_dim: int = 64  # each head's rotary query/key channels (the key's shared by all heads)
    v_head_dim: int = 128  # each head's value channels
    # RoPE (under multi-latent attention its rotary part's): rope (plain, model.rotary_base), or yarn (the long-context
    # scaling of DeepSeek-V3, Kimi K2 and GPT-OSS, set by the keys below; megatron-core's names and defaults)
    rope_type: RopeType = "rope"
    rotary_scaling_factor: float = 40.0  # yarn: the context's extension (DeepSeek-V3: 40, Kimi K2: 32)
    original_max_position_embeddings: int = 4096  # yarn: the context the frequencies were first trained for
    beta_fast: float = 32.0  # yarn: frequencies turning more often than this over that context are kept
    beta_slow: float = 1.0  # yarn: frequencies turning less often than this are interpolated fully
    mscale: float = 1.0  # yarn: cos/sin are scaled by (0.1·mscale·ln(factor) + 1) / the same with mscale_all_dim
    mscale_all_dim: float = 0.0  # yarn: the softmax scale is multiplied by (0.1·this·ln(factor) + 1)² (DeepSeek-V3: 1)
    # yarn: the frequency band's edges rounded to whole channels (transformers' truncate; GPT-OSS: false). Multi-latent
    # attention's YaRN always rounds
    correction_range_round_to_int: bool = True
    # Mixture-of-Experts (docs/moe.md): an MoE layer's MLP is this many experts and a router; null = dense
    num_moe_experts: Optional[int] = None
    # which decoder layers are MoE layers, the others dense SwiGLUs of ffn_hidden_size: N = every N-th from the first
    # (1: all), or a 0/1 flag per layer (DeepSeek-V3's first three dense: [0, 0, 0, 1, ...])
    moe_layer_freq: Union[int, list[int]] = 1
    moe_ffn_hidden_size: Optional[int] = None  # each expert's SwiGLU width; null = ffn_hidden_size
    moe_router_topk: int = 2  # experts each token is routed to
    moe_router_score_function: MoEScoreFunction = "softmax"  # router scores: softmax, or sigmoid (with expert bias)
    # the top-k scores as the experts' weights: false = softmax over the chosen k (Mixtral, Qwen3-MoE); true =
    # softmax over all experts first (needed for top-1 with softmax scores)
    moe_router_pre_softmax: bool = False
    # load balancing: aux_loss (over the micro batch), seq_aux_loss (per sequence), none (e.g. with expert bias)
    moe_router_load_balancing_type: MoELoadBalancing = "aux_loss"
    moe_aux_loss_coeff: float = 0.01  # weight of the load-balancing loss
    # aux-loss-free balancing: a per-expert bias added to the scores for the choice, updated from the load (needs
    # moe_router_score_function=sigmoid)
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 0.001  # step of the expert-bias update
    # benchmark mode: every token routed to an even spread of experts whatever the router says (megatron-core's
    # moe_router_force_load_balancing, as Megatron-Bridge's published MoE throughputs run); never for a real run
    moe_router_force_load_balancing: bool = False
    # group-limited routing (DeepSeek-V3): the experts in this many groups, a token's experts chosen from its
    # moe_router_group_topk best groups (a group scored by the sum of its best topk/group_topk experts); null = off
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None  # with moe_router_num_groups: the groups a token's experts come from
    # the chosen experts' weights multiplied by this (DeepSeek-V3's routed_scaling_factor 2.5); null = 1
    moe_router_topk_scaling_factor: Optional[float] = None
    # each expert takes at most capacity_factor × its even share of tokens, the rest dropped; null = dropless
    moe_expert_capacity_factor: Optional[float] = None
    moe_token_drop_policy: MoETokenDropPolicy = "probs"  # with a capacity: drop the lowest-score tokens, or the last
    moe_pad_expert_input_to_capacity: bool = False  # with a capacity: pad every expert's input to it
    # width of the shared experts every token also goes through (their count × each one's width); null = none
    moe_shared_expert_intermediate_size: Optional[int] = None
    # how tokens reach their experts' ranks: alltoall (the usual choice with EP), allgather, or flex (fused
    # dispatch kernels, moe_flex_dispatcher_backend; TransformerEngine on a GPU)
    moe_token_dispatcher_type: MoETokenDispatcher = "alltoall"
    moe_flex_dispatcher_backend: MoEFlexBackend = "deepep"  # flex: DeepEP's kernels, or HybridEP's
    # the experts' GEMMs as one grouped GEMM (TransformerEngine's TEGroupedMLP): auto = on in TE layers; true needs
    # them; off = one GEMM per expert (megatron-core's SequentialMLP)
    moe_grouped_gemm: AutoBool = AUTO
    # multi-token prediction (DeepSeek-V3: 1): this many extra layers after the last, the k-th predicting the token k+1
    # ahead from the previous one's output and the embedding of the token k ahead, through the shared output layer;
    # their losses (mtp/loss_k) added, scaled, to the main loss in training; null = off
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1  # the MTP losses' weight (their mean over the MTP layers; DeepSeek-V3: 0.3 → 0.1)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1  # TP: each layer's matrices split over this many GPUs
    pipeline_model_parallel_size: int = 1  # PP: the layers split into this many stages
    virtual_pipeline_model_parallel_size: Optional[int] = None  # chunks per stage (interleaved 1F1B); null = off
    context_parallel_size: int = 1  # CP: each sequence split over this many GPUs (long context)
    expert_model_parallel_size: int = 1  # EP: an MoE layer's experts split over this many GPUs
    # ETP: each expert's matrices split over this many GPUs; null = tensor_model_parallel_size (1 for experts with
    # biases: megatron-core splits those over TP never)
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False  # norms and dropout split over the TP group along the sequence (TP > 1)
    use_distributed_optimizer: bool = True  # optimizer state and main weights sharded over DP (ZeRO-1)
    num_layers_in_first_pipeline_stage: Optional[int] = None  # uneven PP: layers of the first stage
    num_layers_in_last_pipeline_stage: Optional[int] = None  # uneven PP: layers of the last stage
    # shard over DP×CP with megatron-core's Megatron-FSDP instead of DDP (data_parallel_sharding_strategy says what)
    use_megatron_fsdp: bool = False
    # with use_megatron_fsdp: optim_grads (ZeRO-2: optimizer state and gradients) or optim_grads_params (ZeRO-3: and
    # the parameters, gathered layer by layer); ZeRO-1 is use_distributed_optimizer without Megatron-FSDP
    data_parallel_sharding_strategy: ShardingStrategy = "optim_grads_params"
    # HSDP with use_megatron_fsdp: shard within each of this many groups of consecutive DP×CP ranks (one node
    # each, say) and keep one replica per group, so gathers stay on the fast links; 1 = shard over all of DP×CP
    num_distributed_optimizer_instances: int = 1
    # HSDP across the groups: no_shard (replicas; gradients all-reduced across them once per step) or optim (the
    # optimizer state sharded across them too; needs optim_grads_params)
    outer_dp_sharding_strategy: OuterShardingStrategy = "no_shard"
    overlap_grad_reduce: bool = False  # reduce gradients over DP in buckets during the backward pass
    # elements per gradient bucket with overlap_grad_reduce (first model chunk of pipeline stage 0, where megatron-core
    # buckets); null = megatron-core's max(4e7, 1e6 × DP)
    ddp_bucket_size: Optional[int] = None
    overlap_param_gather: bool = False  # gather updated parameters during the next forward pass (distributed opt.)
    # TP communication overlapped with the GEMMs that need it (TransformerEngine's userbuffers; sequence parallel,
    # on a GPU)
    tp_comm_overlap: bool = False
    # MoE: one micro batch's expert all-to-alls overlapped with another's compute (megatron-core's 1F1B A2A overlap,
    # on GPUs: EP > 1, the alltoall or flex dispatcher, bf16, interleaved pipeline stages when PP > 1)
    overlap_moe_expert_parallel_comm: bool = False
    # a collective that waits longer than this fails the job; auto = from the plan at launch: at least 10, and 5
    # minutes above the hang timeout and the planned checkpoint write (a rank may wait for another's)
    distributed_timeout_minutes: AutoNumber = AUTO
    auto: bool = False  # replace the layout above by the planner's best for the started world size
    # a started world the layout or global batch does not fit trains on the largest one that fits (lower DP) and
    # the other ranks exit; recipes.launch sets it for elastic launches (--nnodes MIN:MAX)
    allow_idle_ranks: bool = False
    auto_gpu: Optional[str] = None  # planner GPU for auto (h100-80gb, h200-141gb, ...); null = detect


@dataclass
class TrainConfig:
    train_iters: int = 100  # optimizer steps of the whole run
    global_batch_size: int = 8  # samples per optimizer step, over all DP ranks and micro batches
    micro_batch_size: int = 1  # samples per forward/backward pass on one rank
    seed: int = 1234  # base seed (megatron-core derives per-rank streams from it)
    eval_interval: int = 50  # validation every this many steps
    eval_iters: int = 4  # validation batches per evaluation
    # parameters and compute: fp32, bf16, or fp16 with dynamic loss scaling (GPUs without bf16: V100, T4); fp32 main
    # weights in the optimizer for both 16-bit ones
    precision: Precision = "fp32"
    initial_loss_scale: float = 65536.0  # fp16: the first loss scale (megatron-core's DynamicGradScaler)
    min_loss_scale: float = 1.0  # fp16: the scale's floor; an overflow with the scale there stops the run
    loss_scale_window: int = 1000  # fp16: steps without an overflow before the scale doubles
    hysteresis: int = 2  # fp16: overflows before the scale halves
    # TransformerEngine FP8 recipe (hybrid: E4M3 forward, E5M2 gradients; TE's layers, bf16): delayed and tensorwise
    # on compute capability 8.9+ (Ada, Hopper, Blackwell), blockwise on 9.0+, mxfp8 on Blackwell (10.x); null = off
    fp8: Optional[FP8Recipe] = None
    # TransformerEngine FP4 recipe of the linear layers (NVFP4; TE's layers, bf16, Blackwell 10.0+); not with
    # train.fp8; null = off
    fp4: Optional[FP4Recipe] = None
    # keep the parameters in FP8 and all-gather them in FP8 under the distributed optimizer (megatron-core's
    # fp8_param + fp8_param_gather); needs train.fp8
    fp8_param_gather: bool = False
    recompute_granularity: Optional[RecomputeGranularity] = None  # activation recompute; null = off
    # selective recompute: which modules' outputs are recomputed in the backward pass (megatron-core's
    # recompute_modules); [] = megatron-core's default, core_attn
    recompute_modules: list[RecomputeModule] = field(default_factory=list)
    # the first this many decoder layers' activations kept in host memory between forward and backward
    # (megatron-core's layer-level cpu_offloading; TransformerEngine on a GPU, PP 1, no recompute); 0 = off
    cpu_offloading_num_layers: int = 0
    # Activation offload: the inputs of these modules, saved for the backward pass, wait in host memory instead of
    # on the GPU (megatron-core's fine_grained_activation_offloading, copies on side streams overlapped with
    # compute; docs/memory.md). Needs TransformerEngine on a GPU. [] = off
    offload_modules: list[OffloadModule] = field(default_factory=list)
    min_offloaded_tensor_size: int = 1048576  # activation offload: smaller saved tensors (elements) stay on the GPU
    fused_swiglu: bool = False  # megatron-core's fused SwiGLU (bias_activation_fusion, torch.compile'd)
    # megatron-core's fused vocab-parallel cross-entropy (TE's with TE); auto = on in bf16 (its only precision)
    fused_cross_entropy: AutoBool = AUTO
    # torch.compile every transformer layer (local layer spec); auto = on for local dense layers on a GPU, off on
    # CPU, with TransformerEngine and for MoE layers (inductor failed on them on an H100) (measured on an H100: +13-20 % tokens/s, docs/performance.md)
    compile: AutoBool = AUTO
    # liger-kernel's Triton RMSNorm, SwiGLU and vocab-parallel cross-entropy through its megatron-core adapter
    # (local layer spec on a GPU; `pip install liger-kernel==0.8.5`). Refused on CPU and with TE. Unmeasured.
    liger_kernels: bool = False
    # The output layer and cross-entropy as one chunked liger-kernel kernel (megatron_ext/model/fused_output.py):
    # the [seq, batch, vocab] logits never exist, freeing memory for a larger micro batch. GPU, TP=1. Unmeasured.
    fused_linear_cross_entropy: bool = False
    # megatron-core's CUDA graphs, so kernel launches cost no CPU time (docs/performance.md): none; per decoder layer,
    # replayed from the step after their capture — local (megatron-core's own, captured in the first step; its local
    # layers) or transformer_engine (TE's make_graphed_callables after 3 eager steps; TE's layers); or
    # full_iteration (a step's whole forward-backward schedule as one graph, captured at the fourth step). A GPU,
    # eager layers (compile auto turns off), pipeline size 1. Unmeasured
    cuda_graph_impl: CudaGraphImpl = "none"
    # per-layer graphs (local, transformer_engine): capture only these regions of each layer (megatron-core's
    # cuda_graph_modules; moe/moe_router/moe_preprocess in MoE layers); [] = the whole layer; must be [] otherwise
    cuda_graph_modules: list[CudaGraphModule] = field(default_factory=list)
    exit_interval: Optional[int] = None  # stop (and checkpoint) once iteration % exit_interval == 0
    exit_signal_handler: bool = True  # checkpoint and exit cleanly on SIGTERM/SIGUSR1
    # No finished step (or evaluation batch) for this long (after the first step): stacks to the rank logs, stopped
    # ranks named, job ends (exit 4) for SLURM to requeue. auto = from the plan at launch: twice the planned stretch
    # between the steps where the loop reads the device (logging.log_interval steps), at least 300 s; null = off.
    # Widened as the run goes to twice the longest stretch seen, and kept below parallel.distributed_timeout_minutes
    # so that it fires first
    hang_timeout_s: AutoNumber = AUTO
    skip_nonfinite_steps: int = 0  # skip up to N steps with a non-finite loss/gradient before stopping
    # A loss more than spike_threshold median absolute deviations (at least 1 % of the median each) above the median of
    # the previous spike_window steps is a spike: warn; skip its update (the run reads every step's loss before its
    # update); or rewind to checkpoint.save's newest checkpoint and continue on the data after the spike (also past a
    # non-finite step that skip_nonfinite_steps does not skip; docs/monitoring.md "Loss spikes"); off = not checked
    spike_policy: SpikePolicy = "warn"
    spike_window: int = 50  # steps in the median; spikes are looked for once a fifth of them are seen
    spike_threshold: float = 10.0  # median absolute deviations above the median
    max_rewinds: int = 3  # skip/rewind: the spikes a run acts on; the next one stops it (exit 3)
    # megatron-core's rerun state machine. validate_results: a step whose loss or gradients are non-finite on a rank
    # (or, under spike_policy=skip, whose loss is a spike) is run again from the same state before anything else; if the re-run is finite, the fault was transient and the
    # step goes on with the re-run's result (one line names the rank's node and device), else train.recurring_fault
    # decides. Costs a host sync per step. report_determinism_stats: every step runs twice, and
    # train/rerun_relative_difference says how far apart (docs/monitoring.md "Re-running a step")
    rerun_mode: RerunModeName = "disabled"
    # validate_results, when a step's fault recurs on its re-run: policies (skip_nonfinite_steps and spike_policy
    # decide) or rerun_elsewhere (megatron-core's diagnosis: checkpoint before the step and exit 16; the SLURM
    # templates requeue without the node, where the step runs again: a fault that recurs there is the data's or the
    # model's and the policies decide, one that does not was that GPU's and the run goes on)
    recurring_fault: RecurringFault = "policies"


@dataclass
class OptimizerSection:
    # adam (AdamW), or muon: megatron-core's Muon (emerging-optimizers' Newton-Schulz orthogonalized momentum) on
    # every 2-D hidden weight, AdamW on embeddings, the output layer, norms and biases (megatron-core's split); with
    # parallel.use_distributed_optimizer megatron-core's layer-wise distributed optimizer shards Muon's state by
    # whole matrices over DP (docs/optimizer.md)
    name: OptimizerName = "adam"
    lr: float = 3e-4  # peak learning rate (of both optimizers with muon)
    min_lr: float = 3e-5  # learning rate at the end of the decay
    weight_decay: float = 0.1  # decoupled weight decay (AdamW)
    clip_grad: float = 1.0  # gradient-norm clipping threshold
    lr_warmup_iters: int = 0  # linear warm-up steps
    lr_decay_iters: Optional[int] = None  # null = train_iters (or warmup + 1 for runs shorter than warmup)
    lr_decay_style: LRDecayStyle = "cosine"  # megatron-core's schedule after warm-up
    # WSD (warm-up, stable, decay): the LR holds at optimizer.lr, then anneals to min_lr over the last N of the decay
    # iterations (required with WSD)
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_style: WSDDecayStyle = "linear"  # the shape of WSD's anneal
    adam_beta1: float = 0.9  # Adam beta1
    adam_beta2: float = 0.95  # Adam beta2
    adam_eps: float = 1e-8  # Adam epsilon
    # torch AdamW's single-kernel update where megatron-core falls back to torch (no TE/apex
    # FusedAdam); false = torch's multi-pass foreach update.
    fused_adam: bool = True
    # Keep optimizer_offload_fraction of the optimizer state (fp32 master weights, Adam moments) in host memory, stepped
    # by torch AdamW on the CPU (megatron-core's HybridDeviceOptimizer; docs/memory.md). Needs the distributed
    # optimizer and bf16.
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0  # of the optimizer state on the host, with optimizer_cpu_offload
    # Muon's options (megatron-core's OptimizerConfig names), with optimizer.name=muon
    muon_momentum: float = 0.95  # the momentum's EMA coefficient
    muon_nesterov: bool = False  # Nesterov momentum
    muon_num_ns_steps: int = 5  # Newton-Schulz iterations per orthogonalization
    muon_scale_mode: MuonScaleMode = "spectral"  # spectral: sqrt(max(rows, cols)), as Moonlight and Kimi K2
    muon_extra_scale_factor: float = 1.0  # times the mode's scale: 0.2 matches AdamW's update RMS (Moonlight)
    muon_split_qkv: bool = True  # orthogonalize each head's Q, K and V blocks of the fused QKV weight apart
    muon_tp_mode: MuonTPMode = "blockwise"  # blockwise: each TP shard on its own; distributed: the whole matrix
    # Newton-Schulz's fp32 matmuls: medium lets them run in bf16 (fast; the layouts then differ beyond fp32's order
    # of sums), highest keeps them fp32
    muon_fp32_matmul_prec: MatmulPrecision = "medium"


@dataclass
class DataConfig:
    # A Megatron-style blend: [prefix] or [w1, prefix1, w2, prefix2, ...] (weights need not sum to 1).
    blend: Optional[list[Any]] = None
    # Per-split blends override `blend` + `split` (each in the same form as `blend`).
    train_blend: Optional[list[Any]] = None
    valid_blend: Optional[list[Any]] = None  # the validation split's own blend
    test_blend: Optional[list[Any]] = None  # the test split's own blend
    split: str = "98,2,0"  # train,valid,test proportions of `blend`
    tokenizer_model: Optional[str] = None  # a sentencepiece .model or a Hugging Face tokenizer directory
    tokenizer_type: Optional[TokenizerType] = None  # null = from the path (a directory is a Hugging Face one)
    mock: bool = False  # random tokens (megatron-core MockGPTDataset): benchmarks and smoke tests
    num_workers: int = 0  # data-loader worker processes per rank
    path_to_cache: Optional[str] = None  # where megatron-core caches its dataset indices; null = next to the data
    # Packed sequences (megatron-core GPTDatasetConfig's names; docs/data.md "Document masking"):
    reset_attention_mask: bool = False  # a token attends only to its own document's earlier tokens
    reset_position_ids: bool = False  # positions, and so RoPE's rotation, restart at each document
    eod_mask_loss: bool = False  # no loss where the input token is EOD (guessing the next document's first token)


@dataclass
class CheckpointConfig:
    save: Optional[str] = None  # checkpoint directory to write; null = no checkpoints
    # Where a run resumes from (model, optimizer, scheduler, RNG, consumed samples). auto: checkpoint.save, so a
    # relaunched or requeued run goes on where it stopped (an empty directory is a fresh start); null: train from
    # scratch; a path: another run's checkpoint directory
    load: Optional[str] = AUTO
    pretrained_checkpoint: Optional[str] = None  # weights only, start at iteration 0
    save_interval: Optional[int] = None  # null = only at the end
    # Also save once this many minutes have passed since the last save (or the start), so a crash loses at most
    # that much work whatever the step time; decided on rank 0's clock at a step boundary. null = off
    save_interval_minutes: Optional[float] = None
    keep_last: Optional[int] = None  # delete older complete checkpoints beyond the newest N (null = keep all)
    keep_every: Optional[int] = None  # with keep_last: also keep every iteration that is a multiple of this
    # Write in the background (megatron-core's async dist_checkpointing). null = on GPUs, where it cut the
    # 1.2B recipe's stall per 17 GB save from 30-40 s to 0.5 s on an H100; off in CPU rehearsal.
    async_save: Optional[bool] = None
    # The distributed optimizer's state in megatron-core's format of this name (see OptimizerFormat).
    optimizer_format: OptimizerFormat = "auto"


@dataclass
class StorageConfig:
    # NVIDIA multi-storage-client's configuration file (its profiles: a bucket, its endpoint and credentials), through
    # which msc://PROFILE/path prefixes in data.*blend are read (megatron-core's object-storage datasets,
    # docs/data.md) and checkpoint.save/load/pretrained_checkpoint written and read (docs/checkpointing.md); an
    # s3://BUCKET/path is the profile its path_mapping maps it to (else the bucket with the environment's AWS
    # credentials); null = local paths only. The run names its own: MSC_CONFIG and ~/.msc_config.yaml are not read
    msc_config: Optional[str] = None
    # local directory for the object-storage datasets' index (.idx) files, which megatron-core downloads once and
    # reads from (the .bin is read in ranges, never copied whole); null = data.path_to_cache's object_storage/, else
    # runs/<recipe.name>/object_storage
    cache: Optional[str] = None


@dataclass
class LoggingConfig:
    tensorboard_dir: Optional[str] = None  # TensorBoard event files; null = none
    log_interval: int = 1  # a console line (and scalars) every this many steps
    gpu_peak_tflops: Optional[float] = None  # overrides the built-in table for MFU
    log_dir: Optional[str] = None  # per-rank tracebacks and hang stacks (rank-N.log); null = runs/<recipe.name>/logs
    # warn about a rank (TP group) computing this × slower than its pipeline stage's others, or than it did; null = off
    straggler_factor: Optional[float] = 1.2
    straggler_intervals: int = 3  # a rank is named a straggler after this many slow log intervals in a row
    # MoE: warn when one expert gets more than this share of its layer's tokens (an even split gives top-k/experts) for
    # moe_collapse_intervals log intervals in a row (routing collapse); null = off
    moe_collapse_share: Optional[float] = 0.5
    moe_collapse_intervals: int = 3  # log intervals in a row before routing collapse is warned about
    # time each step's parts (megatron-core's regions; CUDA events on a GPU): the time/ breakdown, advice, the
    # summary's check against the planner, and the straggler check need it; false = no timers at all
    step_breakdown: bool = True
    # [first, last]: torch.profiler traces (Chrome/Perfetto JSON) of these iterations, into <run dir>/profile/
    profile_steps: Optional[list[int]] = None
    profile_ranks: list[int] = field(default_factory=lambda: [0])  # the ranks that write a trace
    profile_with_stack: bool = False  # Python stacks in the trace (larger files, slower steps)
    # GPU: a torch.cuda.memory snapshot (allocations with their stacks) at the end of the profiled iterations
    memory_snapshot: bool = False
    # Weights & Biases project: the TensorBoard scalars and the resolved config, from rank 0 (docs/monitoring.md;
    # WANDB_MODE=offline works without a network); a relaunch appends to the same W&B run; null = off
    wandb_project: Optional[str] = None
    wandb_entity: Optional[str] = None  # W&B entity (team or user); null = your default
    wandb_run_name: Optional[str] = None  # W&B run name; null = recipe.name


@dataclass
class RecipeConfig:
    recipe: RecipeMeta = field(default_factory=RecipeMeta)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _yaml_line(path: Path, dotted_key: str) -> Optional[int]:
    """1-based line of `dotted_key` in a YAML file, so errors can point at it."""
    try:
        node = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return None
    for part in dotted_key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        for key_node, value_node in node.value:
            if key_node.value == part:
                node = value_node
                break
        else:
            return None
    return node.start_mark.line + 1


def _first_line(message: str) -> str:
    """OmegaConf's message without the object-type lines it appends."""
    return message.strip().splitlines()[0]


def without_retired_keys(saved: dict[str, Any]) -> dict[str, Any]:
    """A config saved by an earlier version (a checkpoint's) without the keys it no longer has."""
    kept = {section: dict(values) if isinstance(values, dict) else values for section, values in saved.items()}
    for key in RETIRED_KEYS:
        section, name = key.split(".")
        if isinstance(kept.get(section), dict):
            kept[section].pop(name, None)
    return kept


def _refusal(e: OmegaConfBaseException) -> str:
    """Why a key was refused: a retired key names its successor."""
    successor = RETIRED_KEYS.get(e.full_key or "")
    return f"was replaced by {successor}" if successor else _first_line(e.msg)


@functools.cache
def config_defaults() -> DictConfig:
    """The schema with its defaults, as OmegaConf merges configs over it. Built once: it is most of a config load's
    time (23 of 40 ms), and a merge copies it rather than changing it."""
    return OmegaConf.structured(RecipeConfig)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RecipeConfig:
    """YAML file (optional) merged over the defaults, then `section.key=value` overrides (values as written, nothing
    read from the environment: :mod:`megatron_ext.config.values`)."""
    merged = config_defaults()
    path = Path(path) if path is not None else None
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            from_file = OmegaConf.load(path)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or _first_line(str(e))}"
                              ) from None
        try:
            merged = OmegaConf.merge(merged, from_file)
        except OmegaConfBaseException as e:
            line = _yaml_line(path, e.full_key) if e.full_key else None
            where = f"{path}:{line}" if line else str(path)
            raise ConfigError(f"{where}: {e.full_key}: {_refusal(e)}") from None
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        try:
            parsed.append(override_as_config(RecipeConfig, item))
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {item!r}: {e.full_key or item}: {_refusal(e)}") from None
    try:  # in one merge: each merge copies the whole config first
        merged = OmegaConf.merge(merged, *parsed) if parsed else merged
    except OmegaConfBaseException:
        for item, override in zip(overrides, parsed):  # the first refused, one at a time, names itself
            try:
                merged = OmegaConf.merge(merged, override)
            except OmegaConfBaseException as e:
                raise ConfigError(f"override {item!r}: {e.full_key or item}: {_refusal(e)}") from None
    if merged is config_defaults():  # nothing merged over it: checked_values expands a leading ~ in place
        merged = copy.deepcopy(merged)
    checked_values(merged)
    cfg = OmegaConf.to_object(merged)
    check_ranges(cfg.to_dict())
    return cfg


def hang_timeout_s(cfg: RecipeConfig) -> Optional[float]:
    """train.hang_timeout_s as a number of seconds (None: off); an unresolved auto is the floor."""
    value = cfg.train.hang_timeout_s
    return HANG_TIMEOUT_FLOOR_S if value == AUTO else value


def collective_timeout_minutes(cfg: RecipeConfig) -> float:
    """parallel.distributed_timeout_minutes as a number; an unresolved auto is the floor."""
    value = cfg.parallel.distributed_timeout_minutes
    return COLLECTIVE_TIMEOUT_FLOOR_MINUTES if value == AUTO else value


def decides_before_update(cfg: RecipeConfig) -> bool:
    """Whether every step's loss and gradient flags must reach the host before its update (fp16's grad scaler reads
    its overflow flag anyway; train.skip_nonfinite_steps and train.spike_policy=skip skip the step): such runs read
    the device every step."""
    t = cfg.train
    return t.skip_nonfinite_steps > 0 or t.precision == "fp16" or t.spike_policy == "skip"


def recomputed_modules(cfg: RecipeConfig) -> tuple[str, ...]:
    """The modules selective recompute repeats in the backward pass: train.recompute_modules, or megatron-core's
    default where it names none (core attention); () without selective recompute."""
    t = cfg.train
    if t.recompute_granularity != "selective":
        return ()
    return tuple(t.recompute_modules) or ("core_attn",)


def steps_between_device_reads(cfg: RecipeConfig) -> int:
    """The most steps the training loop runs without reading the device (an evaluation or a save may come
    sooner): the host can run that far ahead, so the longest stretch between two steps it sees finish is that
    many steps long."""
    return 1 if decides_before_update(cfg) else cfg.logging.log_interval


def data_parallel_size(cfg: RecipeConfig, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )


def expert_data_parallel_size(world_size: int, pp: int, ep: int, etp: int) -> int:
    """megatron-core's expert layers regroup the ranks of a pipeline stage as ETP × EP × expert-DP: the ranks that
    reduce (and, with the distributed optimizer, shard) each expert's gradients."""
    return world_size // (pp * ep * etp)


def lr_decay_iterations(cfg: RecipeConfig) -> int:
    """The iterations the LR schedule decays over: optimizer.lr_decay_iters, else train.train_iters (at least one past
    the warm-up, which megatron-core's scheduler needs)."""
    o = cfg.optimizer
    return o.lr_decay_iters or max(cfg.train.train_iters, o.lr_warmup_iters + 1)


def microbatches_per_step(cfg: RecipeConfig, world_size: int) -> int:
    """Micro batches each data-parallel rank runs per training step (the pipeline schedule's m)."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_parallel_size(cfg, world_size))


def ddp_bucket_size(cfg: RecipeConfig, dp: int) -> Optional[int]:
    """Elements per gradient bucket where megatron-core's DDP buckets (the first chunk of pipeline stage 0), as it
    sizes them from parallel.ddp_bucket_size over `dp` data-parallel ranks; None = one bucket (no overlap)."""
    p = cfg.parallel
    if not p.overlap_grad_reduce:
        return None
    return p.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)


def pipeline_stage_layers(cfg: RecipeConfig) -> list[int]:
    """Decoder layers on each pipeline stage, as megatron-core splits them: parallel.num_layers_in_first/last_
    pipeline_stage where set, the rest evenly over the other stages."""
    p, layers = cfg.parallel, cfg.model.num_layers
    pp, first, last = p.pipeline_model_parallel_size, p.num_layers_in_first_pipeline_stage, \
        p.num_layers_in_last_pipeline_stage
    if pp == 1:
        return [layers]
    middle = pp - (first is not None) - (last is not None)
    rest = (layers - (first or 0) - (last or 0)) // middle if middle else 0
    return [first if i == 0 and first is not None else last if i == pp - 1 and last is not None else rest
            for i in range(pp)]


def expert_tensor_parallel_size(cfg: RecipeConfig) -> int:
    """ETP as megatron-core builds it: parallel.expert_tensor_parallel_size, or where it is null what the model
    implies (:func:`model_expert_tensor_parallel_size`), else TP."""
    p = cfg.parallel
    return p.expert_tensor_parallel_size or model_expert_tensor_parallel_size(cfg.model) or p.tensor_model_parallel_size


def model_expert_tensor_parallel_size(model: ModelConfig) -> Optional[int]:
    """The ETP a model fixes whatever the layout: 1 for experts with biases (model.add_bias_linear), which
    megatron-core never splits over TP; None where it follows the layout."""
    return 1 if model.add_bias_linear and model.num_moe_experts else None


def log_dir(cfg: RecipeConfig) -> str:
    """Where each rank writes its tracebacks and hang stacks."""
    return cfg.logging.log_dir or f"runs/{cfg.recipe.name}/logs"


def object_storage_cache(cfg: RecipeConfig) -> str:
    """Where the object-storage datasets' index files are kept (storage.cache)."""
    if cfg.storage.cache:
        return cfg.storage.cache
    if cfg.data.path_to_cache:
        return str(Path(cfg.data.path_to_cache) / "object_storage")
    return f"runs/{cfg.recipe.name}/object_storage"


def profile_dir(cfg: RecipeConfig) -> Path:
    """Where profiler traces and memory snapshots go: beside the rank logs, in the run directory."""
    return Path(log_dir(cfg)).parent / "profile"


def resume_dir(cfg: RecipeConfig) -> Optional[str]:
    """The checkpoint directory this run resumes from: checkpoint.load, with auto meaning checkpoint.save."""
    ck = cfg.checkpoint
    return ck.save if ck.load == AUTO else ck.load


def parse_blend(blend: Optional[list[Any]], key: str) -> Optional[tuple[list[str], Optional[list[float]]]]:
    """Megatron's [w1, p1, w2, p2] or [p1, p2] list → (prefixes, weights) as megatron-core wants it."""
    if not blend:
        return None
    items = list(blend)
    if all(isinstance(x, str) for x in items):
        return items, None
    if len(items) % 2 or not all(
        isinstance(w, (int, float)) and isinstance(pfx, str) for w, pfx in zip(items[::2], items[1::2])
    ):
        raise ConfigError(
            f"{key}={items!r} is invalid: use [prefix, ...] or [weight1, prefix1, weight2, prefix2, ...]"
        )
    weights = [float(w) for w in items[::2]]
    if not all(w > 0 for w in weights):
        raise ConfigError(f"{key}={items!r} is invalid: every weight must be > 0")
    return list(items[1::2]), weights


# ---------------------------------------------------------------------------------------------
# The key reference (--list-keys, docs/config-keys.md), read from this schema


@dataclass(frozen=True)
class KeyHelp:
    key: str  # section.key
    type: str  # as written in the schema (Optional[int]), or a Literal's values (auto / te / local)
    default: Any
    help: str


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the one on its line, else the comment lines directly above it."""
    source = inspect.getsource(cls)
    comments: dict[int, tuple[bool, str]] = {}  # line → (a line of its own, text)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            whole_line = tok.line.strip().startswith("#")
            comments[tok.start[0]] = (whole_line, tok.string.lstrip("#").strip())
    help_of = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            _, text = comments.get(node.lineno, (False, ""))
            if not text:
                above, previous = [], node.lineno - 1
                while comments.get(previous, (False, ""))[0]:
                    above.insert(0, comments[previous][1])
                    previous -= 1
                text = " ".join(above)
            help_of[node.target.id] = text
    return help_of


def allowed_values(annotation: Any) -> tuple[Any, ...]:
    """The values a Literal (or Optional Literal) annotation admits, None included; () for other types."""
    if typing.get_origin(annotation) is Literal:
        return get_args(annotation)
    if typing.get_origin(annotation) is typing.Union:
        args = get_args(annotation)
        values = tuple(v for arg in args for v in allowed_values(arg))
        return (None, *values) if values and type(None) in args else values
    return ()


def shown_value(value: Any) -> str:
    """A config value as it is written in YAML and on the command line: null, true/false, "" for empty."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if value != "" else '""'


def config_keys() -> Iterator[KeyHelp]:
    """Every `section.key` of the schema with its type, default and help."""
    for section in dataclasses.fields(RecipeConfig):
        cls = section.default_factory
        help_of, hints = _field_comments(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            allowed = allowed_values(hint)
            items = allowed_values(get_args(hint)[0]) if typing.get_origin(hint) is list else ()
            key = f"{section.name}.{f.name}"
            if key in AUTO_NUMBER_KEYS:
                allowed = ("number", AUTO, *((None,) if AUTO_NUMBER_KEYS[key] else ()))
            kind = (" / ".join(map(shown_value, allowed)) if allowed
                    else f"list of {' / '.join(map(shown_value, items))}" if items else str(f.type))
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            yield KeyHelp(key, kind, default, help_of[f.name])


def keys_table() -> str:
    """The key reference as a Markdown table."""
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    rows += [f"| `{k.key}` | {k.type} | `{shown_value(k.default)}` | {k.help.replace('|', '/')} |"
             for k in config_keys()]
    return "\n".join(rows) + "\n"
