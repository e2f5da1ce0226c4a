"""TE-shaped stand-ins, for tests only: TransformerEngine's checkpoint contracts where TE cannot be installed.

* :class:`TEShapedSpecProvider` feeds megatron-core's own TE layer spec (``get_gpt_decoder_block_spec``
  with ``use_transformer_engine=True``) plain torch/megatron modules that present what megatron-core's TE
  wrappers present to a checkpoint: the norms fused into ``linear_qkv``/``linear_fc1`` as
  ``layer_norm_weight``, an ``_extra_state`` on every TE module (TE ``module/base.py`` ``get_extra_state``:
  an empty uint8 tensor without FP8), the final norm a ``TENorm`` with its own ``_extra_state`` (TE
  ``ops/op.py``), and no sharded state for core attention (megatron-core's ``TEDotProductAttention``), which takes
  TE's packed-sequence (THD) input as megatron-core hands it over: [tokens, heads, dim] and ``PackedSeqParams``.
  They compute what the local layers compute, so a run keeps its losses when it moves between the specs.
  ``tests/golden/te_spec_sharded_keys.txt`` holds the keys megatron-core's TE spec produces; the
  stand-ins are checked against it, and so is real TE where a GPU has it (``keys`` mode below).
* MoE layers: megatron-core's own ``TEGroupedMLP`` (the TE spec with ``moe_grouped_gemm``) over
  :class:`TEColumnParallelGroupedLinear` / :class:`TERowParallelGroupedLinear`, which present TE ``GroupedLinear``
  as megatron-core's wrappers do (``extensions/transformer_engine.py``): one weight per local expert (``weight0``,
  ``weight1``, ...), one ``_extra_state`` saved once per expert in a distributed checkpoint (``_extra_state``,
  ``_extra_state1``, ...) and merged back on load, each expert's tensors sharded on the global expert axis and
  replicated over expert-DP — so a checkpoint's keys are SequentialMLP's (the local spec's).
  ``tests/golden/te_spec_moe_sharded_keys.txt`` holds the keys of a 2-layer MoE model.
* :class:`FusedAdamStandIn` has TE FusedAdam's state contract (TE 2.9-2.11 ``optimizers/fused_adam.py``):
  the step is an ``int`` in each param group (a float reaches a kernel taking ``int``: TypeError), each
  group needs ``bias_correction``, and ``state_dict()``/``load_state_dict()`` look every per-param state
  key up in a dtype map of ``exp_avg``/``exp_avg_sq``/``master_param`` (anything else: KeyError).

Run as ``python -m tests.workers.te_standin --config ... [overrides]`` (under torchrun) to train with both installed;
``python -m tests.workers.te_standin keys [--real-te]`` prints the sharded keys of a 2-layer dense and MoE model
under each spec (JSON: te, te_moe, local, local_moe).
"""

from __future__ import annotations

import json
import sys
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import ExpertsBuilder
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from megatron_ext.model.attention import SDPAttention
from megatron_ext.model.llama import RMSNorm


class _TEExtraState:
    """TE modules checkpoint their FP8 metadata as ``_extra_state``: an empty uint8 tensor without FP8."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        if state is not None and not isinstance(state, torch.Tensor):
            raise TypeError(f"TE extra state must be a tensor, got {type(state).__name__}")


class TELayerNormColumnParallelLinear(_TEExtraState, ColumnParallelLinear):
    """RMSNorm fused into the column-parallel linear, its weight named ``layer_norm_weight`` (TE LayerNormLinear)."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel
        self.eps = config.layernorm_epsilon

    def forward(self, x: torch.Tensor):
        return super().forward(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps))


class TEColumnParallelLinear(_TEExtraState, ColumnParallelLinear):
    """megatron-core's TEColumnParallelLinear as a checkpoint sees it (the shared experts' fc1)."""


class TERowParallelLinear(_TEExtraState, RowParallelLinear):
    """megatron-core's TERowParallelLinear as a checkpoint sees it."""


class _TEGroupedLinear(_TEExtraState, torch.nn.Module):
    """TE GroupedLinear under megatron-core's wrapper: `num_gemms` local experts' weights, each split over expert-TP
    on TP_AXIS, ``forward(x, m_splits)`` = expert e's GEMM over its ``m_splits[e]`` rows. No communication: under
    expert parallelism or expert-TP the token dispatcher does it (megatron-core's ``explicit_expert_comm``)."""

    TP_AXIS: int  # of a [out, in] weight: 0 column-parallel, 1 row-parallel

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__()
        assert is_expert and not bias, "stand-in for the recipe's bias-free experts only"
        self.num_gemms, self.groups = num_gemms, pg_collection
        shape = [output_size, input_size]
        shape[self.TP_AXIS] = divide(shape[self.TP_AXIS], pg_collection.expt_tp.size())
        for gemm in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype))
            if config.perform_initialization:
                init_method(weight)
            set_tensor_model_parallel_attributes(weight, True, self.TP_AXIS, 1)
            self.register_parameter(f"weight{gemm}", weight)
        self._register_load_state_dict_pre_hook(self._merge_extra_states)

    def forward(self, x: torch.Tensor, m_splits: list[int]):
        parts = torch.split(x, m_splits)
        return torch.cat([F.linear(part, getattr(self, f"weight{e}")) for e, part in enumerate(parts)]), None

    def _merge_extra_states(self, state_dict, prefix, *_):
        """A distributed checkpoint holds the extra state once per expert; the module has one (no FP8: all equal)."""
        for gemm in range(1, self.num_gemms):
            state_dict.pop(f"{prefix}_extra_state{gemm}", None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None) -> dict:
        """Expert e's weight and extra state under SequentialMLP's keys: a TP-sharded tensor with one more axis, the
        global expert index, after `sharded_offsets`; replicated over expert-DP (not DP)."""
        ep, local = self.groups.ep, self.state_dict(prefix="", keep_vars=True)
        sharded = {}
        for gemm in range(self.num_gemms):
            expert_axis = (len(sharded_offsets), ep.rank() * self.num_gemms + gemm, ep.size() * self.num_gemms)
            entries = make_sharded_tensors_for_checkpoint(
                {"weight": local[f"weight{gemm}"], "_extra_state": local["_extra_state"]}, prefix,
                {"weight": self.TP_AXIS}, (*sharded_offsets, expert_axis),
                tp_group=self.groups.expt_tp, dp_cp_group=metadata["dp_cp_group"])
            sharded[f"{prefix}weight{gemm}"] = entries[f"{prefix}weight"]
            sharded[f"{prefix}_extra_state{gemm or ''}"] = entries[f"{prefix}_extra_state"]
        for entry in sharded.values():
            entry.replica_id = (*entry.replica_id[:2], self.groups.expt_dp.rank())
        return sharded


class TEColumnParallelGroupedLinear(_TEGroupedLinear):
    """The experts' fc1."""

    TP_AXIS = 0


class TERowParallelGroupedLinear(_TEGroupedLinear):
    """The experts' fc2."""

    TP_AXIS = 1


class TENorm(_TEExtraState, RMSNorm):
    """The final norm: te.pytorch.RMSNorm, an FP8-aware op with its own ``_extra_state``."""


class TEDotProductAttention(SDPAttention):
    """Core attention with TE's packed-sequence contract (megatron-core ``TEDotProductAttention`` with ``qkv_format=
    'thd'``): query/key/value [t, heads, dim] — the batch dimension squeezed out by megatron-core's Attention — and
    int32 ``cu_seqlens`` over t; causal attention within each segment; out [t, heads·dim]."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        p, t = packed_seq_params, query.size(0)
        cu_seqlens = p.cu_seqlens_q
        assert p.qkv_format == "thd" and attention_mask is None and query.dim() == 3, (p.qkv_format, query.shape)
        assert cu_seqlens.dtype == torch.int32 and torch.equal(cu_seqlens, p.cu_seqlens_kv), cu_seqlens
        assert cu_seqlens[0] == 0 and cu_seqlens[-1] == t, (cu_seqlens, t)
        assert p.max_seqlen_q == p.max_seqlen_kv == int(cu_seqlens.diff().max()), p
        lengths = cu_seqlens.diff().to(torch.int64)
        segments = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None]
        q, k, v = (x.permute(1, 0, 2)[None] for x in (query, key, value))  # [1, heads, t, dim]
        return self.attend(q, k, v, segments)[0].permute(1, 0, 2).reshape(t, -1)


class TEShapedSpecProvider(TESpecProvider):
    """megatron-core's TE backend with the stand-in modules."""

    def column_parallel_linear(self) -> type:
        return TEColumnParallelLinear

    def column_parallel_layer_norm_linear(self) -> type:
        return TELayerNormColumnParallelLinear

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> ExpertsBuilder:
        if moe_use_grouped_gemm:
            return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
                linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear, activation_func=None))
        return partial(SequentialMLP, submodules=MLPSubmodules(
            linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear, activation_func=None))

    def activation_func(self) -> None:
        """The config's activation (SwiGLU), not TE's fused activation op."""
        return None

    def row_parallel_linear(self) -> type:
        return TERowParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
        return TENorm

    def core_attention(self) -> type:
        return TEDotProductAttention


class FusedAdamStandIn(torch.optim.Optimizer):
    """AdamW (torch's single-tensor arithmetic) behind TE FusedAdam's step and state contract."""

    name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, **_: object):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool) -> None:
        for name in ("exp_avg", "exp_avg_sq"):
            self.state[param][name] = torch.zeros_like(param, dtype=self.name_to_dtype_map[name])

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        self.name_to_dtype_map[state_name]  # noqa: B018 -- TE's lookup: KeyError for any other key
        return self.state[param][state_name]

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        assert unscaled_state.dtype == torch.float32, unscaled_state.dtype
        dtype = self.name_to_dtype_map[state_name]
        self.state[param][state_name] = unscaled_state.to(dtype).clone()

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self):
        packed = super().state_dict()
        params = self._params()
        packed["state"] = {index: {name: self.get_unscaled_state(params[index], name) for name in state}
                           for index, state in packed["state"].items()}
        return packed

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for param in self._params():
            saved, self.state[param] = self.state[param], {}
            for name, value in saved.items():
                if value is not None:
                    self.set_scaled_state(param, name, value.float())

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            bias_correction = group["bias_correction"]  # KeyError when absent, as TE's (fused_adam.py:493)
            group["step"] = group["step"] + 1 if "step" in group else 1
            step = group["step"]
            if not isinstance(step, int):  # pybind11 refuses a float for the kernel's `int step`
                raise TypeError(f"multi_tensor_adam(): incompatible function arguments: step={step!r} is not an int")
            beta1, beta2 = group["betas"]
            correction1 = 1 - beta1 ** step if bias_correction else 1.0
            correction2 = (1 - beta2 ** step) ** 0.5 if bias_correction else 1.0
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    self.initialize_state(param, False)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                param.mul_(1 - group["lr"] * group["weight_decay"])
                exp_avg.lerp_(param.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / correction2).add_(group["eps"])
                param.addcdiv_(exp_avg, denom, value=-group["lr"] / correction1)


def install() -> None:
    """Make this process build TE-shaped layers and optimizers where megatron-core and this project pick TE."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.optimizer import distrib_optimizer

    import megatron_ext.model.llama
    import megatron_ext.training.trainer

    gpt_layer_specs.TESpecProvider = TEShapedSpecProvider
    gpt_layer_specs.TENorm = TENorm
    mcore_optimizer.Adam = FusedAdamStandIn
    mcore_optimizer.USING_PYTORCH_OPTIMIZER = False
    distrib_optimizer.Adam = FusedAdamStandIn
    distrib_optimizer.HAVE_APEX_OR_TE = True
    distrib_optimizer.USING_TE_OPTIMIZER = True
    for module in (megatron_ext.model.llama, megatron_ext.training.trainer):
        module.transformer_engine_available = lambda: True


def sharded_keys(use_te: bool, moe: bool = False, model_class: str = "gpt") -> list[str]:
    """`key kind` of every entry of a 2-layer TP1 model's sharded_state_dict (one process); with `moe` every layer's
    MLP 4 experts (grouped GEMM under TE, megatron-core's default there) and a shared expert; `model_class`:
    megatron-core's GPTModel or HybridModel (model.model_class)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from megatron_ext.config.schema import load_config
    from megatron_ext.distributed import cpu_backend
    from megatron_ext.distributed.parallel import destroy_distributed, init_distributed
    from megatron_ext.model.llama import build_model_chunks, transformer_config

    on_gpu = not cpu_backend.install()
    experts = ["model.num_moe_experts=4", "model.moe_shared_expert_intermediate_size=32",
               f"model.moe_grouped_gemm={use_te}"] if moe else []
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                             "model.num_query_groups=2", "model.seq_length=32", "model.vocab_size=128", *experts,
                             f"model.model_class={model_class}"])
    init_distributed(cfg, on_gpu)
    try:
        chunk = build_model_chunks(cfg, 128, transformer_config(cfg, on_gpu, use_te), use_te)[0]
        if on_gpu:
            chunk.cuda()
        entries = {f"{value.key} {type(value).__name__}" for value in nested_values(chunk.sharded_state_dict())}
    finally:
        destroy_distributed()
    return sorted(entries)


if __name__ == "__main__":  # guard required: dist_checkpointing's save spawns processes
    if sys.argv[1:2] == ["keys"]:
        if "--real-te" not in sys.argv:
            install()
        print(json.dumps({f"{spec}{'_moe' * moe}{'_hybrid' * (cls == 'hybrid')}":
                          sharded_keys(use_te=spec == "te", moe=moe, model_class=cls)
                          for spec in ("te", "local") for moe in (False, True) for cls in ("gpt", "hybrid")}))
        sys.exit(0)
    install()
    from recipes.pretrain import entry_point

    entry_point()
