"""Checkpoints of Megatron-FSDP runs (ZeRO-2/3): megatron-core's ``fsdp_dtensor`` format, written with torch DCP.

Each parameter and each of its Adam moments is one DTensor (the global tensor; every rank writes its shard), so a
checkpoint loads under any DP size and either sharding strategy (ZeRO-2 ↔ ZeRO-3): DCP reshards on load. SwiGLU's
fused ``linear_fc1`` is stored as its two halves (``weight_w``/``weight_v``), as megatron-core's
``handle_swiglu_in_state_dict`` and Megatron-LM's ``--ckpt-format fsdp_dtensor`` write it, so the halves stay whole
when TP changes. What is not a tensor (iteration, samples, config, LR schedule, every rank's RNG) is rank 0's
``common.pt``, where dist_checkpointing keeps its own, so a checkpoint's readers need not know its format.

Megatron-FSDP keeps no grad buffers in the distributed optimizer's layout, so these checkpoints do not load into a
ZeRO-1/plain-DP run (nor theirs into Megatron-FSDP): :func:`load_weights_into` reads the weights alone, for
``recipes.convert``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict

from megatron_ext.checkpoint import compat, model_class, safe_unpickle
from megatron_ext.checkpoint.async_save import writer_modules
from megatron_ext.checkpoint.common_state import CommonState
from megatron_ext.checkpoint.layout import COMMON_STATE, DCP_METADATA, DIST_METADATA
from megatron_ext.distributed.parallel import device

FORMAT = "fsdp_dtensor"  # megatron-core's distrib_optim_sharding_type and Megatron-LM's --ckpt-format
_WRAPPER = "module."  # what each wrapper (FSDP adapter, MegatronFSDP) adds in front of a parameter's name
SWIGLU_HALVES = ("_w", "_v")  # the suffixes of linear_fc1's gate and up halves in the checkpoint


class _ParameterLookup:
    """The model as megatron-core's checkpoint handlers ask for it: parameters by name at any wrapper depth.

    They look model keys and optimizer keys up with different numbers of ``module.`` in front (the two come from
    different wrapper levels), which no single wrapper resolves; the parameter they mean is the same."""

    def __init__(self, chunk: torch.nn.Module):
        self.root = chunk
        while hasattr(self.root, "module"):
            self.root = self.root.module
        self.config = self.root.config

    def named_modules(self, *args, **kwargs):
        """The unwrapped chunk's modules: megatron-core's handle_swiglu_in_state_dict walks the layers."""
        return self.root.named_modules(*args, **kwargs)

    def get_parameter(self, name: str) -> torch.nn.Parameter:
        while name.startswith(_WRAPPER):
            name = name[len(_WRAPPER):]
        return self.root.get_parameter(name)


def _dtensor_state(model_chunks: list, optimizer: MegatronOptimizer, is_loading: bool
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer as DCP saves them, and the same state as the model and optimizer give and take it
    (before the SwiGLU split, whose halves are views into it): DCP loads into the first, which fills the second."""
    (chunk,) = model_chunks  # Megatron-FSDP runs with PP=1 and no VPP
    compat.fill_empty_adam_state(optimizer)
    model = chunk.state_dict_for_save_checkpoint()
    moments = optimizer.sharded_state_dict({"model": model}, is_loading=is_loading,
                                           metadata={"distrib_optim_sharding_type": FORMAT})
    own = {"model": model, "optimizer": moments}
    if chunk.config.gated_linear_unit:
        model, moments = handle_swiglu_in_state_dict(_ParameterLookup(chunk), model, moments)
    state = {"model": model, "optimizer": moments}
    preprocess_state_dict_for_uneven_dtensor(state)
    return state, own


def _agree_on_step_counts(optimizer_state: dict[str, Any]) -> None:
    """Collective: every rank's Adam step count of a parameter set to the largest (in place).

    A rank whose shard of a parameter is empty never steps it, so its count stays 0; DCP writes each replicated
    value from one rank of its choosing, which may be that one (measured: every norm weight's step saved as 0
    at DP2, and the resumed run diverged from the uninterrupted one)."""
    steps = [moments["step"] for _, moments in sorted(optimizer_state["state"].items()) if "step" in moments]
    if not steps:
        return
    # torch Adam keeps its steps on the host unless fused; NCCL reduces device tensors only
    agreed = torch.stack([step.float().to(device()) for step in steps])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    for step, value in zip(steps, agreed):
        step.fill_(value.item())


def save(model_chunks: list, optimizer: MegatronOptimizer, target: Path, common: CommonState,
         asynchronous: bool) -> Optional[Any]:
    """Collective: write the checkpoint into `target` (rank 0 writes `common`); with `asynchronous` only plan it
    and return the request that writes it (megatron-core's async DCP writer, as torch_dist's async save)."""
    state, own = _dtensor_state(model_chunks, optimizer, is_loading=False)
    _agree_on_step_counts(own["optimizer"])
    if dist.get_rank() == 0:
        torch.save(common.saved(), target / COMMON_STATE)
    if not asynchronous:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target)))
        return None
    writer_module = writer_modules()  # NVRx's, as the torch_dist format's async writes
    writer = writer_module["FileSystemWriterAsync"](str(target))
    planned = writer_module["save_state_dict_async_plan"](state, writer, None, 0, planner=dcp.DefaultSavePlanner())
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    finalize = writer_module["save_state_dict_async_finalize"]
    return writer_module["AsyncRequest"](save_fn, save_args, [lambda: finalize(*planned)], preload_fn=preload_fn)


def load(ckpt_dir: Path, model_chunks: list, optimizer: MegatronOptimizer) -> None:
    """Collective: the model weights and optimizer moments of `ckpt_dir`, resharded to this run's DP size. Also in a
    run that has trained (a spike rewind): Megatron-FSDP's parameter gathers still in flight or held from the last
    step are settled and released first, so the next forward pass gathers the loaded shards."""
    for chunk in model_chunks:
        chunk.synchronize_param_gather()
    state, own = _dtensor_state(model_chunks, optimizer, is_loading=True)
    with safe_unpickle.refusals_named(ckpt_dir):
        reader = dcp.FileSystemReader(str(ckpt_dir))
        state = model_class.gpt_fsdp_state_for_hybrid(state, set(reader.read_metadata().state_dict_metadata),
                                                       model_chunks[0].config)
        dcp.load(state, storage_reader=reader)
    model_chunks[0].load_state_dict(own["model"])
    compat.follow_the_configs_schedule(optimizer, own["optimizer"])  # the loaded groups hold the saved schedule
    optimizer.load_state_dict(own["optimizer"])


def holds_format(ckpt_dir: Path) -> bool:
    """`ckpt_dir` was written in this format (DCP's metadata, no dist_checkpointing metadata)."""
    return (ckpt_dir / DCP_METADATA).is_file() and not (ckpt_dir / DIST_METADATA).is_file()


def embedding_rows(ckpt_dir: Path) -> int:
    """The (padded) vocabulary rows of the checkpoint's word embeddings, from DCP's metadata alone."""
    with safe_unpickle.refusals_named(ckpt_dir):
        metadata = dcp.FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    return int(metadata[f"model.{_WRAPPER}embedding.word_embeddings.weight"].size[0])


def load_weights_into(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """The full weights of `ckpt_dir` into `model`, an unwrapped GPTModel at TP=1 (a world of one)."""
    targets: dict[str, torch.Tensor] = {}
    fused: dict[str, str] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(compat.EXTRA_STATE_SUFFIX):
            continue
        if name.endswith("mlp.linear_fc1.weight") and model.config.gated_linear_unit:
            gate, up = torch.empty_like(tensor).chunk(2, dim=0)
            targets[_WRAPPER + name + SWIGLU_HALVES[0]], targets[_WRAPPER + name + SWIGLU_HALVES[1]] = gate, up
            fused[name] = _WRAPPER + name
        else:
            targets[_WRAPPER + name] = torch.empty_like(tensor)
    wrapped = {"model": targets}
    with safe_unpickle.refusals_named(ckpt_dir):
        dcp.load(wrapped, storage_reader=dcp.FileSystemReader(str(ckpt_dir)))
    halves = {key + half for key in fused.values() for half in SWIGLU_HALVES}
    weights = {name[len(_WRAPPER):]: tensor for name, tensor in targets.items() if name not in halves}
    for name, key in fused.items():
        weights[name] = torch.cat([targets[key + half] for half in SWIGLU_HALVES])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    left = [k for k in missing if not k.endswith(compat.EXTRA_STATE_SUFFIX)]
    if left or unexpected:
        raise RuntimeError(f"fsdp_dtensor weight mapping bug: unset {left}, unknown {unexpected}")
