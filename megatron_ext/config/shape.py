"""The model's shape with every default resolved, and what follows from it alone: the padded vocabulary, the
parameter count and the model FLOPs per token.

The one place these rules live: config validation, the model build, metrics (MFU), the Hugging Face converter,
the resume checks and the planner all read a :class:`ModelShape`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from megatron_ext.config.schema import ModelConfig, RecipeConfig, RecomputeGranularity


def default_ffn_hidden_size(hidden_size: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * hidden_size / 3) / 256)


def padded_vocab_size(vocab_size: int, make_divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's rule: the embedding rows are a multiple of make_divisible_by × TP."""
    multiple = make_divisible_by * tensor_parallel_size
    return multiple * math.ceil(vocab_size / multiple)


def moe_layer_pattern(moe_layer_freq: Union[int, list[int]], num_layers: int) -> tuple[int, ...]:
    """Which decoder layers are MoE layers (1) and which dense (0), as megatron-core reads ``moe_layer_freq``: an
    integer N makes every N-th layer from the first an MoE layer, a list gives each layer's flag."""
    if isinstance(moe_layer_freq, int):
        return tuple(int(i % moe_layer_freq == 0) for i in range(num_layers))
    return tuple(int(flag) for flag in moe_layer_freq)


def window_layer_pattern(window_size: Optional[Any], window_attn_skip_freq: Optional[Union[int, list[int]]],
                         num_layers: int) -> tuple[int, ...]:
    """Which decoder layers attend through the sliding window (1) and which fully (0), as megatron-core reads
    ``window_attn_skip_freq`` (transformer/utils.py ``is_layer_window_attention``; a unit test holds the two equal):
    null = every layer, N = all but every N-th counting from 1, a list = its flags; () without a window."""
    if not window_size:
        return ()
    if window_attn_skip_freq is None:
        return (1,) * num_layers
    if isinstance(window_attn_skip_freq, int):
        return tuple(int((layer + 1) % window_attn_skip_freq != 0) for layer in range(num_layers))
    return tuple(int(bool(flag)) for flag in window_attn_skip_freq)


def cached_by_section(cache: dict, section: Any, key: tuple, compute: Callable[[], Any]) -> Any:
    """`compute()`'s result for config section `section` (and `key`), remembered while the section holds the values
    it held then: the planner asks for the same section's derived shapes hundreds of thousands of times in a search,
    and comparing its fields is much cheaper than hashing them (sections are mutable, so identity alone would not
    do)."""
    values = vars(section)
    entry = cache.get((id(section), *key))
    if entry is not None and entry[0] == values:
        return entry[1]
    result = compute()
    if len(cache) >= 4096:
        cache.clear()
    cache[(id(section), *key)] = ({k: list(v) if isinstance(v, list) else v for k, v in values.items()}, result)
    return result


_SHAPES: dict[tuple, tuple[dict[str, Any], "ModelShape"]] = {}
# the model.* key of each ModelShape field named otherwise (tied_embeddings is that key negated)
_CONFIG_KEY = {"tied_embeddings": "untie_embeddings_and_output_weights", "num_experts": "num_moe_experts",
               "expert_ffn_hidden_size": "moe_ffn_hidden_size", "router_topk": "moe_router_topk",
               "shared_expert_ffn_hidden_size": "moe_shared_expert_intermediate_size",
               "moe_layers": "moe_layer_freq", "linear_biases": "add_bias_linear", "qkv_bias": "add_qkv_bias",
               "attention_sinks": "softmax_type"}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads
    kv_channels: int  # head dimension
    ffn_hidden_size: int
    seq_length: int
    tied_embeddings: bool
    qk_layernorm: bool = False  # a norm over each query and key head
    num_experts: int = 0  # experts per MoE layer; 0 = dense
    expert_ffn_hidden_size: int = 0  # each expert's SwiGLU width
    router_topk: int = 0  # experts per token
    shared_expert_ffn_hidden_size: int = 0  # the shared experts' SwiGLU width, 0 = none
    # per decoder layer, 1 for an MoE layer and 0 for a dense one (ffn_hidden_size wide); () for a dense model
    moe_layers: tuple[int, ...] = ()
    mtp_num_layers: int = 0  # multi-token prediction layers after the decoder, each of the last layer's kind
    # multi-latent attention (0 where it is off)
    multi_latent_attention: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    # GPT-OSS's pieces: a bias in every linear layer, or only in the query/key/value projection; a learned sink logit
    # per head; a sliding window of `window` earlier keys on the layers window_layers flags (() = none)
    linear_biases: bool = False
    qkv_bias: bool = False
    attention_sinks: bool = False
    window: int = 0
    window_layers: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: ModelConfig | Mapping[str, Any]) -> ModelShape:
        """From a model section, or its dict as a checkpoint saved it (missing optional keys mean their default)."""
        if isinstance(model, Mapping):
            return cls._of(model)
        return cached_by_section(_SHAPES, model, (), lambda: cls._of(vars(model)))

    @classmethod
    def _of(cls, m: Mapping[str, Any]) -> ModelShape:
        hidden, heads = m["hidden_size"], m["num_attention_heads"]
        ffn = m.get("ffn_hidden_size") or default_ffn_hidden_size(hidden)
        experts = m.get("num_moe_experts") or 0
        mla = bool(m.get("multi_latent_attention", False))
        window = tuple(m["window_size"]) if m.get("window_size") else None
        latent = {key: m.get(key, getattr(ModelConfig, key)) if mla else 0 for key in (
            "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")}
        return cls(
            num_layers=m["num_layers"], hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=m.get("num_query_groups") or heads,
            kv_channels=m.get("kv_channels") or hidden // heads,
            ffn_hidden_size=ffn,
            seq_length=m.get("seq_length", ModelConfig.seq_length),
            tied_embeddings=not m.get("untie_embeddings_and_output_weights", True),
            qk_layernorm=m.get("qk_layernorm", False),
            num_experts=experts,
            expert_ffn_hidden_size=(m.get("moe_ffn_hidden_size") or ffn) if experts else 0,
            router_topk=m.get("moe_router_topk", ModelConfig.moe_router_topk) if experts else 0,
            shared_expert_ffn_hidden_size=(m.get("moe_shared_expert_intermediate_size") or 0) if experts else 0,
            moe_layers=moe_layer_pattern(m.get("moe_layer_freq", 1), m["num_layers"]) if experts else (),
            mtp_num_layers=m.get("mtp_num_layers") or 0,
            multi_latent_attention=mla, **latent,
            linear_biases=bool(m.get("add_bias_linear", False)),
            qkv_bias=bool(m.get("add_bias_linear", False) or m.get("add_qkv_bias", False)),
            attention_sinks=m.get("softmax_type", "vanilla") == "learnable",
            window=window[0] if window else 0,
            window_layers=window_layer_pattern(window, m.get("window_attn_skip_freq"), m["num_layers"]),
        )

    def parameter_shapes(self) -> dict[str, Any]:
        """``model.<key>`` → its resolved value, for every setting that decides the shapes of the parameters (all of
        the shape's fields but the sequence length and top-k)."""
        values = {f"model.{_CONFIG_KEY.get(f.name, f.name)}": getattr(self, f.name) for f in fields(self)
                  if f.name not in ("seq_length", "router_topk", "window", "window_layers")}
        values["model.untie_embeddings_and_output_weights"] = not values["model.untie_embeddings_and_output_weights"]
        values["model.softmax_type"] = "learnable" if self.attention_sinks else "vanilla or off-by-one"
        return values

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0; num_layers + k: the k-th MTP layer's, of the last layer's kind) is
        an MoE layer."""
        return self._moe_flags[min(layer, self.num_layers - 1)]

    @functools.cached_property
    def _moe_flags(self) -> tuple[bool, ...]:  # is_moe_layer's answers (a search asks millions of times)
        return tuple(self.is_moe and bool(self.moe_layers[layer]) for layer in range(self.num_layers))

    def mlp_parameters(self, active: bool = False, moe: bool = True) -> int:
        """One layer's MLP parameters: the SwiGLU's, or (`moe`, in an MoE model) an MoE layer's router, experts and
        shared experts (`active`: only the top-k experts a token goes through)."""
        h = self.hidden_size
        if not (moe and self.is_moe):
            return self._glu_parameters(self.ffn_hidden_size)
        experts = self.router_topk if active else self.num_experts
        router = (h + int(self.linear_biases)) * self.num_experts
        shared = self._glu_parameters(self.shared_expert_ffn_hidden_size) if self.shared_expert_ffn_hidden_size else 0
        return router + experts * self._glu_parameters(self.expert_ffn_hidden_size) + shared

    def _glu_parameters(self, width: int) -> int:
        """A GLU MLP of `width`: up (gate and linear halves), down, and their biases with linear_biases."""
        h = self.hidden_size
        return 3 * h * width + ((2 * width + h) if self.linear_biases else 0)

    @property
    def query_key_head_dim(self) -> int:
        """Each head's query (and key) channels: multi-latent attention's non-rotary + rotary parts, else the head
        dimension."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else self.kv_channels

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.multi_latent_attention else self.kv_channels

    @property
    def key_value_channels(self) -> int:
        """Each token's key and value channels over the query groups (multi-latent attention: every head's, from the
        compressed KV): what context parallelism passes around its ring."""
        return self.num_query_groups * (self.query_key_head_dim + self.value_head_dim)

    def attention_parameters(self) -> int:
        """One layer's attention projection weights (its norms left out), with their biases and the sinks.
        Multi-latent attention: the query's down- and up-projections, the KV down-projection (to the compressed KV and
        the shared rotary key) and up-projection (to every head's non-rotary key and value), the output projection."""
        h, n = self.hidden_size, self.num_attention_heads
        if not self.multi_latent_attention:  # (and the biases, the sinks)
            d, qkv = self.kv_channels, n + 2 * self.num_query_groups
            return (h * d * qkv + n * d * h + (d * qkv if self.qkv_bias else 0) + (h if self.linear_biases else 0)
                    + (n if self.attention_sinks else 0))
        queries = self.q_lora_rank * (h + n * self.query_key_head_dim)
        keys_values = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + self.kv_lora_rank * n * (
            self.qk_head_dim + self.v_head_dim)
        return queries + keys_values + n * self.v_head_dim * h

    def num_parameters(self, vocab_size: int, active: bool = False) -> int:
        """Parameters with a `vocab_size`-row embedding (unpadded: as published model cards count them); `active`:
        those one token goes through (an MoE model's top-k experts only)."""
        layers = sum(self.layer_parameters(layer, active) for layer in range(self.num_layers + self.mtp_num_layers))
        embeddings = vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return layers + embeddings + self.hidden_size  # (the final norm)

    def layer_parameters(self, layer: int, active: bool = False) -> int:
        """Decoder layer `layer`'s parameters (from 0; num_layers + k: the k-th MTP layer's, its projection and norms
        included); `active`: those one token goes through (an MoE layer's top-k experts only)."""
        mtp = self.mtp_projection_parameters() if layer >= self.num_layers else 0
        return (self.attention_parameters() + self._norm_parameters_per_layer()
                + self.mlp_parameters(active, moe=self.is_moe_layer(layer)) + mtp)

    def matrix_parameters(self, vocab_size: int) -> int:
        """The parameters in 2-D weights other than the embedding and the output layer: what megatron-core's Muon
        orthogonalizes (its layer-wise optimizer's rule; the norms, the embedding and the output layer take Adam)."""
        layers = self.num_layers + self.mtp_num_layers
        norms = layers * self._norm_parameters_per_layer() + self.hidden_size + self.mtp_num_layers * 3 * self.hidden_size
        embeddings = vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_parameters(vocab_size) - norms - embeddings - self._vector_parameters()

    def _vector_parameters(self) -> int:
        """The biases and sinks over all layers: 1-D, so Adam's under Muon (as the norms)."""
        if not (self.linear_biases or self.qkv_bias or self.attention_sinks):
            return 0
        plain = dataclasses.replace(self, linear_biases=False, qkv_bias=False, attention_sinks=False)
        return self.num_parameters(0) - plain.num_parameters(0)

    def mtp_projection_parameters(self) -> int:
        """What an MTP layer has besides its decoder layer: the norms of the embedding and of the previous hidden
        states, the projection of the two back to the hidden size, its final norm (the embedding and the output layer
        are the model's)."""
        h = self.hidden_size
        return 3 * h + 2 * h * h

    def _norm_parameters_per_layer(self) -> int:
        if self.multi_latent_attention:  # and the compressed query's and KV's norms
            return 2 * self.hidden_size + self.q_lora_rank + self.kv_lora_rank
        return 2 * self.hidden_size + (2 * self.kv_channels if self.qk_layernorm else 0)

    def is_window_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) attends through the sliding window (an MTP layer never does)."""
        return layer < len(self.window_layers) and bool(self.window_layers[layer])

    def attention_flops_per_token(self, causal: bool = True, windowed: bool = False) -> float:
        """One layer's score and value matmuls, forward+backward, for one token: 6·heads·(query/key + value
        channels)·s over all of the score matrix (how torchtitan counts), half of it causal. Through the sliding window
        (`windowed`) a query sees w = window + 1 keys at most: on average w - w²/(2s) of them causally (the first w
        queries fewer), twice that (at most s) counted non-causally."""
        channels = self.query_key_head_dim + self.value_head_dim
        s, w = self.seq_length, self.window + 1
        keys = s / 2 if not windowed or w >= s else w - w * w / (2 * s)
        return 6.0 * channels * self.num_attention_heads * (keys if causal else min(2 * keys, s))

    def layer_flops_per_token(self, layer: int, causal: bool = True,
                              recompute: Optional[RecomputeGranularity] = None) -> float:
        """Decoder layer `layer`'s (from 0) forward+backward FLOPs for one token: 6 × the matmul parameters it goes
        through (attention's projections; the MLP, or an MoE layer's router, top-k experts and shared experts; norms,
        biases and sinks excluded) + its attention; with `recompute`, what the backward pass repeats: the whole
        forward (full) or attention's (selective) — hardware FLOPs, not model FLOPs."""
        return self._layer_flops_per_token(self.is_moe_layer(layer), causal, recompute, self.is_window_layer(layer))

    def _layer_flops_per_token(self, moe: bool, causal: bool, recompute: Optional[RecomputeGranularity],
                               windowed: bool = False) -> float:
        def count() -> float:
            kinds = self.layer_flops_by_kind(moe, causal, windowed)
            matmuls, attention = kinds["dense_gemm"] + kinds["expert_gemm"], kinds["attention"]
            repeated = {None: 0.0, "selective": attention / 3, "full": (matmuls + attention) / 3}[recompute]
            return matmuls + attention + repeated

        return self._remembered(("layer", moe, causal, recompute, windowed), count)

    @functools.cached_property
    def _memo(self) -> dict[tuple, Any]:
        return {}

    def _remembered(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """`compute()`'s result for `key`, computed once per shape: a planner search asks one shape for the same
        counts across tens of thousands of layouts (a shape is immutable)."""
        memo = self._memo
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    @functools.cached_property
    def _matmuls(self) -> ModelShape:
        """This shape without its biases and sinks: what the FLOP counts multiply (an add is not a matmul)."""
        return dataclasses.replace(self, linear_biases=False, qkv_bias=False, attention_sinks=False)

    def layer_flops_by_kind(self, moe: bool, causal: bool = True, windowed: bool = False) -> dict[str, float]:
        """One decoder layer's forward+backward FLOPs for one token by the kernels that run them: ``dense_gemm``
        (attention's projections, the dense MLP or an MoE layer's router and shared experts), ``expert_gemm`` (the
        top-k experts' grouped GEMMs) and ``attention`` (the score and value matmuls; `windowed`: a sliding-window
        layer's). They sum to the layer's count."""
        return dict(self._remembered(("kinds", moe, causal, windowed),
                                     lambda: self._layer_flops_by_kind(moe, causal, windowed)))

    def _layer_flops_by_kind(self, moe: bool, causal: bool, windowed: bool) -> dict[str, float]:
        plain = self._matmuls
        experts = 6.0 * self.router_topk * 3 * self.hidden_size * self.expert_ffn_hidden_size if (
            moe and self.is_moe) else 0.0
        return {"dense_gemm": 6.0 * (plain.attention_parameters() + plain.mlp_parameters(True, moe)) - experts,
                "expert_gemm": experts, "attention": self.attention_flops_per_token(causal, windowed)}

    def recompute_flops_per_token(self, moe: bool, modules: Iterable[str], windowed: bool = False) -> float:
        """What selective recompute of megatron-core's `modules` repeats in one layer's backward pass, per token:
        each recomputed module's forward (a third of its forward+backward count); layernorm and moe_act are
        elementwise (no FLOPs counted)."""
        modules = tuple(modules)
        return self._remembered(("recompute", moe, modules, windowed),
                                lambda: self._recompute_flops_per_token(moe, modules, windowed))

    def _recompute_flops_per_token(self, moe: bool, modules: tuple[str, ...], windowed: bool) -> float:
        kinds = self.layer_flops_by_kind(moe, windowed=windowed)
        h, n = self.hidden_size, self.num_attention_heads
        up_projections = (n * self.query_key_head_dim * self.q_lora_rank + self.kv_lora_rank * n * (
            self.qk_head_dim + self.v_head_dim)) if self.multi_latent_attention else 0
        shared = 3 * h * self.shared_expert_ffn_hidden_size if moe and self.is_moe else 0
        forward = {"core_attn": kinds["attention"] / 3, "mla_up_proj": 2.0 * up_projections,
                   "mlp": 0.0 if moe and self.is_moe else 2.0 * self._matmuls.mlp_parameters(True, False),
                   "moe": kinds["expert_gemm"] / 3 + 2.0 * (h * self.num_experts + shared) if moe and self.is_moe
                   else 0.0, "shared_experts": 2.0 * shared}
        return sum(forward.get(module, 0.0) for module in modules)

    def output_layer_flops_per_token(self, vocab_size: int) -> float:
        """The output layer's forward+backward FLOPs for one token (a matmul, tied to the embedding or not)."""
        return 6.0 * vocab_size * self.hidden_size

    def flops_per_token(self, vocab_size: int, causal: bool = True) -> float:
        """Forward+backward model FLOPs for one token (Megatron-LM's count with `causal`, as
        ``num_floating_point_operations``, its norm terms aside): every layer's and the output layer's (embedding
        lookups excluded), and each MTP layer's: its projection, its decoder layer and the output layer again."""
        return self.layers_flops_per_token(range(self.num_layers), causal) + self.output_layer_flops_per_token(
            vocab_size) + self.mtp_flops_per_token(vocab_size, causal)

    def mtp_flops_per_token(self, vocab_size: int, causal: bool = True,
                            recompute: Optional[RecomputeGranularity] = None) -> float:
        """The MTP layers' forward+backward FLOPs for one token (0 without MTP)."""
        per_layer = 6.0 * 2 * self.hidden_size ** 2 + self.output_layer_flops_per_token(vocab_size)
        return self.mtp_num_layers * per_layer + self.layers_flops_per_token(
            range(self.num_layers, self.num_layers + self.mtp_num_layers), causal, recompute)

    def layers_flops_per_token(self, layers: Iterable[int], causal: bool = True,
                               recompute: Optional[RecomputeGranularity] = None) -> float:
        """:meth:`layer_flops_per_token` summed over `layers` (each kind of layer counted once, then multiplied: the
        planner asks for many stages of many layouts)."""
        def count(layers: Iterable[int]) -> float:
            kinds = collections.Counter((self.is_moe_layer(layer), self.is_window_layer(layer)) for layer in layers)
            return sum(n * self._layer_flops_per_token(moe, causal, recompute, windowed)
                       for (moe, windowed), n in kinds.items())

        layers = layers if isinstance(layers, range) else tuple(layers)
        return self._remembered(("layers", layers, causal, recompute), lambda: count(layers))


def model_flops_per_token(cfg: RecipeConfig, vocab_size: int, causal: bool = True) -> float:
    """The run's model FLOPs per token: what every MFU — the run log's, the planner's, the plan check's — counts
    (causal attention, the output layer over the vocabulary padded as the model builds it). `causal=False`: the full
    score matrix, as torchtitan and PaLM count it (for comparing with their MFU)."""
    m = cfg.model
    padded = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    return ModelShape.of(m).flops_per_token(padded, causal)
