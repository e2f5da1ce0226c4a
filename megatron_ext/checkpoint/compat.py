"""Checkpoints that move between layer specs and Adam implementations: local + torch AdamW ↔ TransformerEngine.

A run on a CPU or a bare GPU builds megatron-core's local layers and falls back to torch AdamW; in the
NGC container the same recipe builds TE layers and TE's FusedAdam. Their checkpoints differ in two
places, repaired here when loading (saving stays as megatron-core writes it):

* **Model.** TE's norms (``TENorm``, te.pytorch.RMSNorm) save an ``_extra_state`` (its FP8
  metadata) that the local RMSNorm does not have. Every other key maps between the specs through
  megatron-core's own key map (``input_layernorm.weight`` is saved as
  ``self_attention.linear_qkv.layer_norm_weight`` by both). A requested ``_extra_state`` that the
  checkpoint lacks keeps the module's fresh state (empty without FP8; TE derives new FP8 scales as it
  trains); any other absent key is an error naming it.
* **Optimizer.** torch Adam keeps the step count as a per-param float tensor ``state["step"]``; TE
  FusedAdam keeps an ``int`` in each param group, passes it to a CUDA kernel taking ``int``, needs
  ``bias_correction`` in each group, and rejects any per-param state key outside
  ``exp_avg``/``exp_avg_sq``/``master_param`` (TE 2.9-2.11 ``fused_adam.py``, ``state_dict`` and
  ``load_state_dict``). megatron-core's distributed optimizer saves the step in the param groups (a float
  under torch, an int under TE); its other optimizers save torch's as a ``common_step`` state entry.
  :func:`adapt_optimizer_state` rewrites a loaded state to the convention of the optimizer it goes into.

Also the repairs of megatron-core 0.19.2's torch-Adam load path (distrib_optimizer.py:839, :1025-1032,
:1223), which apply to torch Adam only; and the schedule's values in the saved param groups (``max_lr``, ``min_lr``,
``start_wd``, ``end_wd``) follow the config, as the scheduler does: megatron-core 0.19 identifies a saved group by
them too, so a resume with another ``optimizer.lr``, ``min_lr`` or ``weight_decay`` found no group (a bare KeyError).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from megatron_ext.checkpoint import safe_unpickle
from megatron_ext.errors import IncompatibleCheckpointError

safe_unpickle.install()  # every checkpoint read goes through this module (fsdp_dtensor's too)

log = logging.getLogger(__name__)

EXTRA_STATE_SUFFIX = "_extra_state"
# current key part: the one earlier checkpoints have. An MoE layer's pre-MLP norm, which megatron-core's local spec
# saved under the dense TE layer's fused-norm key until this project saved it under its TE spec's (docs/moe.md); the
# model's tensor and, in the fully reshardable optimizer format, its optimizer state
LEGACY_KEYS = {".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


def is_torch_adam(inner: torch.optim.Optimizer) -> bool:
    """megatron-core's fallback optimizer (torch's AdamW subclasses Adam), as opposed to TE's or apex's FusedAdam."""
    return isinstance(inner, torch.optim.Adam)


# where megatron-core's emerging optimizers (Muon: one momentum per matrix) are defined
EMERGING_OPTIMIZER_MODULES = ("megatron.core.optimizer.emerging_optimizers", "emerging_optimizers")


def is_adam(inner: torch.optim.Optimizer) -> bool:
    """Adam in any implementation — torch's, TE's or apex's FusedAdam — as opposed to megatron-core's emerging
    optimizers (Muon)."""
    return not type(inner).__module__.startswith(EMERGING_OPTIMIZER_MODULES)


def megatron_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers a (possibly chained) megatron-core optimizer consists of; chains inside a chain (Muon's
    layer-wise distributed optimizer chains Muon's and Adam's) flattened."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [leaf for opt in chained for leaf in megatron_optimizers(opt)]


def _adam_states(optimizer: MegatronOptimizer) -> Iterator[tuple[torch.optim.Optimizer, dict, torch.Tensor]]:
    for opt in megatron_optimizers(optimizer):
        inner = opt.optimizer
        if not is_adam(inner):  # Muon's state: megatron-core's own init_state_fn builds it for a load
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                yield inner, inner.state[param], param


def fill_empty_adam_state(optimizer: MegatronOptimizer) -> None:
    """Give every param of a fresh Adam the zero state its first step would create.

    megatron-core builds the optimizer part of a checkpoint from the live state, which is empty until
    the first step: its DistributedOptimizer.state_dict() asserts on one torch ``step`` value
    (distrib_optimizer.py:839) and its parameter-state gather expects the moments. TE FusedAdam's state
    is the two moments only (a ``step`` key would make its state_dict() raise KeyError). megatron-core's
    CPU-offload optimizer (HybridDeviceOptimizer) creates its sub-optimizers' state with its own dummy step.
    """
    for opt in megatron_optimizers(optimizer):
        if isinstance(opt.optimizer, HybridDeviceOptimizer) and not opt.optimizer.state:
            opt.optimizer.dummy_step()
    for inner, state, param in _adam_states(optimizer):
        if state:
            continue
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if is_torch_adam(inner):  # where torch Adam keeps it: beside the param when fused or capturable
            on_param = inner.defaults.get("fused") or inner.defaults.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_param else "cpu")


def optimizer_substates(optimizer: MegatronOptimizer, state: Any) -> list[tuple[MegatronOptimizer, dict]]:
    """Pair each megatron-core optimizer with its part of a loaded optimizer state (ChainedOptimizer's layout,
    chains inside a chain followed)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [(optimizer, state)]
    if len(chained) == 1:
        return optimizer_substates(chained[0], state)
    parts = [state[k] for k in sorted(state)] if isinstance(state, dict) else list(state)
    return [pair for opt, part in zip(chained, parts) for pair in optimizer_substates(opt, part)]


def _saved_step(saved: dict) -> Optional[float]:
    """The Adam step count a loaded optimizer state holds, wherever its optimizer kept it; None before step 1."""
    common = saved.get("state", {}).get("common_step")
    if common is not None:
        return float(common)
    steps = {float(g["step"]) for g in saved["param_groups"] if "step" in g}
    if len(steps) > 1:
        raise IncompatibleCheckpointError(f"optimizer param groups hold different step counts {sorted(steps)}")
    return steps.pop() if steps else None


# What the optimizer scheduler sets from the config (training/optimizer.py: override_opt_param_scheduler)
SCHEDULED = ("max_lr", "min_lr", "start_wd", "end_wd")


def schedule_from_the_config(saved_groups: list[dict], current_groups: list[dict]) -> None:
    """The saved param groups take the schedule's values of the current group with the same structure (the other
    identifier keys: weight-decay and LR multipliers, expert and decoupled-LR flags), where that group is one kind."""

    def structure(group: dict) -> tuple:
        return tuple(group.get(key, group.get(f"pre_{key}")) for key in param_group_identifier_keys
                     if key not in SCHEDULED)

    current: dict[tuple, set[tuple]] = {}
    for group in current_groups:
        current.setdefault(structure(group), set()).add(tuple(group.get(key) for key in SCHEDULED))
    for group in saved_groups:
        values = current.get(structure(group), set())
        if len(values) == 1:
            for key, value in zip(SCHEDULED, next(iter(values))):
                if value is None:
                    group.pop(key, None)
                else:
                    group[key] = value


def _saved_substates(optimizer: MegatronOptimizer, state: Any) -> Iterator[tuple[MegatronOptimizer, dict]]:
    """Each megatron-core optimizer with the torch optimizer state dict loaded for it."""
    for opt, part in optimizer_substates(optimizer, state):
        yield opt, part["optimizer"] if "optimizer" in part else part  # FP32Optimizer's is torch's own dict


def follow_the_configs_schedule(optimizer: MegatronOptimizer, state: Any) -> None:
    """A loaded optimizer state's param groups, in place, with the schedule's values of the config (see
    :func:`schedule_from_the_config`). Megatron-FSDP's state holds each parameter's group instead, from which
    megatron-core rebuilds the groups: there the saved values would win over the config's without a word."""
    for opt, saved in _saved_substates(optimizer, state):
        groups = saved["param_groups"] if "param_groups" in saved else list(saved["param_to_group_meta"].values())
        schedule_from_the_config(groups, opt.optimizer.param_groups)


def adapt_optimizer_state(optimizer: MegatronOptimizer, state: Any) -> None:
    """Rewrite a loaded optimizer state, in place, to the step convention of the Adam it is loaded into and to the
    schedule of the config."""
    follow_the_configs_schedule(optimizer, state)
    for opt, saved in _saved_substates(optimizer, state):
        inner = opt.optimizer
        step = _saved_step(saved)
        per_param = saved.get("state")  # present for megatron-core's non-distributed optimizers only
        if not is_adam(inner):  # Muon's state loads as megatron-core saved it
            continue
        if is_torch_adam(inner):
            # The distributed optimizer turns the group step into per-param tensors on load; the others
            # restore per-param steps from 'common_step'.
            if per_param is None:
                for group in saved["param_groups"]:
                    group["step"] = float(step or 0)
            elif per_param:
                per_param["common_step"] = torch.tensor(float(step or 0), dtype=torch.float32)
        else:
            if per_param is not None:
                per_param.pop("common_step", None)
            for group in saved["param_groups"]:
                for key, value in inner.defaults.items():  # e.g. TE's bias_correction, absent from torch's groups
                    group.setdefault(key, value)
                if step is None:
                    group.pop("step", None)
                else:
                    group["step"] = int(step)


def load_optimizer(optimizer: MegatronOptimizer, state: Any) -> None:
    """optimizer.load_state_dict after :func:`adapt_optimizer_state`, with megatron-core 0.19.2's
    torch-Adam load path repaired.

    Under torch Adam, load_state_dict first gives every param one *shared* 'step' tensor
    (distrib_optimizer.py:1025-1032), then copies each param's saved tensors over its state keys, where
    'step' has no source (KeyError at distrib_optimizer.py:1223). Each copy is done with 'step' set aside
    and then restored as the param's own tensor, because torch Adam increments it in place once per param.
    """
    adapt_optimizer_state(optimizer, state)
    steps = [_saved_step(saved) for _, saved in _saved_substates(optimizer, state)]
    repaired = [opt for opt in megatron_optimizers(optimizer)
                if is_torch_adam(opt.optimizer) and hasattr(opt, "_set_main_param_and_optimizer_states")]
    for opt in repaired:
        opt._set_main_param_and_optimizer_states = _step_preserving(opt)
    try:
        optimizer.load_state_dict(state)
    finally:
        for opt in repaired:
            opt.__dict__.pop("_set_main_param_and_optimizer_states", None)
    for opt, step in zip(megatron_optimizers(optimizer), steps):
        if isinstance(opt.optimizer, HybridDeviceOptimizer):
            _complete_offloaded_load(opt.optimizer, step)


def _complete_offloaded_load(hybrid: HybridDeviceOptimizer, step: Optional[float]) -> None:
    """Under CPU offload, put the loaded fp32 master weights and step count where the optimizer steps from.

    megatron-core 0.19.2's distributed optimizer loads its parameter state after HybridDeviceOptimizer's own
    load_state_dict hook has rebuilt its fp32 copies and sub-optimizer states, and puts the loaded weights only into
    its ``state`` (``master_param``): the copies it steps kept what the empty-state dummy step gave them, and so did
    the step counts (1) — which, where megatron-core does set them, are one tensor shared by every parameter, so torch
    AdamW advanced it once per parameter. A resumed run drifted from the uninterrupted one from its second step
    (measured on CPU at DP2, bf16); with each parameter's own restored count it reproduces it exactly.
    """
    with torch.no_grad():
        for param, state in hybrid.state.items():
            if "master_param" in state and param in hybrid.param_to_fp32_param:
                hybrid.param_to_fp32_param[param].copy_(state["master_param"])
        if step is not None:
            for sub in hybrid.sub_optimizers:
                for state in sub.state.values():
                    if torch.is_tensor(state.get("step")):
                        state["step"] = torch.full_like(state["step"], step)


def _step_preserving(opt: MegatronOptimizer):
    copy_states = type(opt)._set_main_param_and_optimizer_states

    def copy_without_step(model_param, tensors):
        group, order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None)
        copy_states(opt, model_param, tensors)
        if step is not None:
            state["step"] = step.clone()

    return copy_without_step


def _load_legacy_keys(state: dict[str, Any], checkpoint_dir: Path) -> None:
    """Point the requests for keys the checkpoint saved under an earlier name (LEGACY_KEYS) at that name."""
    requested = [entry for entry in nested_values(state) if isinstance(entry, ShardedBase)]
    if not any(new in entry.key for entry in requested for new in LEGACY_KEYS):
        return
    saved = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir)).keys()
    for entry in requested:
        for new, old in LEGACY_KEYS.items():
            if new in entry.key and entry.key not in saved and entry.key.replace(new, old) in saved:
                entry.key = entry.key.replace(new, old)


def _shape_problem(state: dict[str, Any], checkpoint_dir: Path) -> Optional[str]:
    """Collective: the first model tensor whose whole (global) shape in `checkpoint_dir` differs from the one this
    run's model requests — on any rank (each holds its pipeline stage's) — said in one line, or None."""
    saved = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
    problem = next((
        f"{checkpoint_dir} holds {entry.key} of shape {list(saved[entry.key].global_shape)} and this run's model "
        f"builds {list(entry.global_shape)}: it was saved from a model of another shape (a vocabulary of another "
        "size pads to another embedding: model.vocab_size, data.tokenizer_model, model.make_vocab_size_divisible_by); "
        "resume it with the model it was saved from, or save this run elsewhere (checkpoint.save)"
        for entry in nested_values(state) if isinstance(entry, ShardedTensor) and not entry.key.startswith("optimizer.")
        and entry.key in saved and tuple(saved[entry.key].global_shape) != tuple(entry.global_shape)), None)
    problems: list[Optional[str]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def load_sharded(state: dict[str, Any], checkpoint_dir: Path) -> dict[str, Any]:
    """dist_checkpointing.load, accepting a checkpoint without the ``_extra_state`` entries the current
    layer spec requests (left out of the result; :func:`load_model_chunks` keeps the fresh ones) and with the
    LEGACY_KEYS names; a model of another shape is refused in one line before anything loads."""
    with safe_unpickle.refusals_named(checkpoint_dir):
        _load_legacy_keys(state, checkpoint_dir)
        problem = _shape_problem(state, checkpoint_dir)
        if problem:
            raise IncompatibleCheckpointError(problem)
        loaded, _, absent = dist_checkpointing.load(state, str(checkpoint_dir),
                                                    strict=StrictHandling.RETURN_UNEXPECTED)
    needed = sorted(key for key in absent if not key.endswith(EXTRA_STATE_SUFFIX))
    if needed:
        shown = ", ".join(needed[:5]) + (f" and {len(needed) - 5} more" if len(needed) > 5 else "")
        raise IncompatibleCheckpointError(
            f"{checkpoint_dir} has no {shown}: it was saved from another model architecture; "
            "check model.* against the config saved with it")
    if absent and torch.distributed.get_rank() == 0:
        log.info(f"{checkpoint_dir} was saved without the layer state of {', '.join(sorted(absent))} "
                 "(another layer spec, e.g. local layers or a Hugging Face import): those start fresh")
    return loaded


def load_model_chunks(models: list[torch.nn.Module], loaded: dict[str, Any]) -> None:
    """Load each unwrapped model chunk's weights from `loaded`; ``_extra_state`` the checkpoint lacked stays as the
    module has it."""
    for i, model in enumerate(models):
        weights = loaded["model"] if len(models) == 1 else loaded[f"model{i}"]
        for key, value in model.state_dict().items():
            if key.endswith(EXTRA_STATE_SUFFIX):
                weights.setdefault(key, value)
        model.load_state_dict(weights)
