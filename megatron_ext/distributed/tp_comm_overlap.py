"""parallel.tp_comm_overlap: TransformerEngine's userbuffers, which overlap sequence parallelism's all-gathers and
reduce-scatters with the GEMMs around them inside TE's layers. megatron-core's TransformerConfig only turns the
overlap on in those layers; the buffers are set up here, once per process, after the process groups and before the
model is built, as Megatron-LM does it (``megatron/training/initialize.py``, ``_initialize_tp_communicators``).
"""

from __future__ import annotations

from megatron_ext.config.schema import RecipeConfig


def userbuffer_shape(cfg: RecipeConfig) -> list[int]:
    """One micro batch's activations on this context-parallel rank, [tokens, hidden]: what each buffer holds."""
    m, p = cfg.model, cfg.parallel
    return [m.seq_length * cfg.train.micro_batch_size // p.context_parallel_size, m.hidden_size]


def initialize_userbuffers(cfg: RecipeConfig) -> None:
    """TE's userbuffers for `cfg` (nothing without parallel.tp_comm_overlap): sized by :func:`userbuffer_shape`,
    quantized to FP8 under train.fp8, bootstrapped over NCCL, with TE's default per-GEMM overlap settings."""
    if not cfg.parallel.tp_comm_overlap:
        return
    from megatron.core.utils import is_te_min_version
    from transformer_engine.pytorch import module as te_module

    shape, tp, fp8 = userbuffer_shape(cfg), cfg.parallel.tensor_model_parallel_size, cfg.train.fp8 is not None
    if is_te_min_version("2.7.0"):
        modes = te_module.base.UserBufferQuantizationMode
        te_module.base.initialize_ub(shape=shape, tp_size=tp, quantization_modes=[modes.FP8 if fp8 else modes.NONE],
                                     ub_cfgs={}, bootstrap_backend="nccl")
    else:
        te_module.base.initialize_ub(shape=shape, tp_size=tp, use_fp8=fp8, ub_cfgs={}, bootstrap_backend="nccl")
