"""CPU rehearsal: lets megatron-core's real CUDA-only code paths run on CPU processes over gloo.

megatron-core 0.19.2 hard-codes CUDA in a few places (``device="cuda"`` in the pipeline
schedules, ``torch.cuda.current_device()`` in p2p, the CUDA RNG tracker, ``tensor.type()``
checks for ``torch.cuda.*`` in gradient clipping and the distributed optimizer, ``.cuda()``
in dist_checkpointing). Instead of forking megatron-core, :func:`install` makes those calls
land on the CPU:

* a :class:`torch.overrides.TorchFunctionMode` rewrites a ``cuda``/integer ``device`` argument
  to ``cpu``, turns ``Tensor.cuda()``/``pin_memory`` into no-ops and makes ``Tensor.type()``
  report the CUDA type name megatron-core asserts on;
* ``torch.cuda`` RNG, ``current_device`` and ``synchronize`` are mapped onto the CPU
  generator / no-ops, and so are megatron-core's private CUDA RNG helpers;
* split sizes given to ``all_to_all_single`` as tensors (megatron-core's MoE token dispatcher hands them over as
  host tensors, as numpy arrays only when they came from a GPU) become the lists gloo takes, and an ``all_gather``
  into tensors of different lengths (its gather of each expert-TP rank's tokens) is padded to the longest, which gloo
  needs;
* ``torch.cuda`` streams and events (Megatron-FSDP's side streams for its gathers and reduce-scatters, activation
  offload's copy streams) are stand-ins that run everything in order on the calling thread; ``record_stream`` and
  NVTX ranges are no-ops;
* so Megatron-FSDP's parameter all-gathers, which it issues asynchronously (alone or coalesced) and orders against
  its bucket frees and reuses through those streams and events, complete before they return: left in flight on
  gloo's worker threads, a gather wrote into freed memory in 1 of 8 HSDP runs at CP2 (``malloc(): unaligned tcache
  chunk detected``, aborted in a gloo thread), and in 0 of 24 with them synchronous.

It is applied only when no GPU is present; on a GPU machine :func:`install` does nothing.
See ``docs/measurements/megatron-core-0.16.1-on-cpu.md`` for the measurements behind each patch (made on 0.16.1;
their targets are unchanged in 0.19.2: ``tests/unit/test_upstream_patches.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext import drop_messages

_installed_mode: TorchFunctionMode | None = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # megatron passes torch.cuda.current_device() (an int) as a device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device placement to the CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if kwargs.get("pin_memory"):  # pinned host memory only speeds up copies to a GPU
            kwargs["pin_memory"] = False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grads / distrib_optimizer assert on "torch.cuda.FloatTensor" style names.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_get_rng_state(device: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


class _NoEvent:
    """A CUDA event on the CPU: everything has already happened."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoStream(_NoEvent):
    """A CUDA stream on the CPU: work runs in order on the calling thread (Megatron-FSDP's side streams)."""

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _NoEvent:
        return _NoEvent()


_THE_STREAM = _NoStream()


@contextlib.contextmanager
def integer_current_device() -> Iterator[None]:
    """``torch.cuda.current_device()`` as the index 0 for a while: Megatron-FSDP builds ``f"cuda:{index}"`` device
    names at construction (the mode sends index devices to the CPU); outside, it stays a device object (see
    :func:`install`)."""
    if _installed_mode is None:
        yield
        return
    saved, torch.cuda.current_device = torch.cuda.current_device, lambda: 0
    try:
        yield
    finally:
        torch.cuda.current_device = saved


@contextlib.contextmanager
def host_offload_stand_ins(model_chunks: list[torch.nn.Module]) -> Iterator[None]:
    """While megatron-core builds its optimizer CPU offload (``HybridDeviceOptimizer``) in CPU rehearsal.

    It offloads what ``param.is_cuda`` says is on the device, and in rehearsal everything is on the host: here the
    tensors in the model's own storage (its weights and their shard views) count as device tensors, as on a GPU, so
    it copies them to the "host" as it would there. Its precision-aware optimizer config compares TransformerEngine's
    version: the stand-in answers "older than 2.1" whatever TE is installed, as megatron-core 0.19.2 does without TE
    (it reads a missing TE as 0.0.0). Only an offload fraction of 1.0 rehearses
    faithfully: a partial split keeps fp32 clones on the device, which here are new host tensors.
    """
    from megatron.core.optimizer import optimizer_config

    device_storage = {p.untyped_storage().data_ptr() for chunk in model_chunks for p in chunk.parameters()}
    te_check = optimizer_config.is_te_min_version
    torch.Tensor.is_cuda = property(lambda t: t.untyped_storage().data_ptr() in device_storage)
    optimizer_config.is_te_min_version = lambda *args, **kwargs: False
    try:
        yield
    finally:
        del torch.Tensor.is_cuda
        optimizer_config.is_te_min_version = te_check


def _all_to_all_single_taking_tensor_splits(all_to_all_single):
    """gloo's ``all_to_all_single`` with split sizes that may be tensors (see the module docstring)."""

    def call(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        splits = [s.tolist() if torch.is_tensor(s) else s for s in (output_split_sizes, input_split_sizes)]
        return all_to_all_single(output, input, *splits, *args, **kwargs)

    return call


class _DoneWork:
    """The handle of a collective that has already completed."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True


def _all_gather_of_uneven_lengths(all_gather):
    """gloo's ``all_gather``, also into a list of tensors whose first dimensions differ (see the module docstring)."""

    def call(tensor_list, tensor, group=None, async_op=False):
        if len({t.shape for t in tensor_list}) <= 1:
            return all_gather(tensor_list, tensor, group, async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(gathered, padded, group)
        for out, got in zip(tensor_list, gathered):
            out.copy_(got[: out.shape[0]])
        return _DoneWork() if async_op else None

    return call


def _all_gather_into_tensor_completed(all_gather_into_tensor):
    """``all_gather_into_tensor`` that has finished when it returns, also when asked for ``async_op``."""

    def call(output_tensor, input_tensor, group=None, async_op=False):
        all_gather_into_tensor(output_tensor, input_tensor, group)
        return _DoneWork() if async_op else None

    return call


def _coalescing_completed(coalescing_manager):
    """torch's ``_coalescing_manager`` whose collectives have finished when the block ends, also with ``async_ops``
    (the manager's ``wait()`` then has nothing left to wait for)."""

    @contextlib.contextmanager
    def manager(group=None, device=None, async_ops=False):
        with coalescing_manager(group, device, async_ops=False) as coalesced:
            yield coalesced

    return manager


def needed() -> bool:
    """True when there is no usable GPU, i.e. when training runs as a CPU rehearsal."""
    return not torch.cuda.is_available()


def install() -> bool:
    """Patch torch/megatron-core for CPU rehearsal if no GPU is present; returns whether it did."""
    global _installed_mode
    if not needed():
        return False
    if _installed_mode is not None:
        return True
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffers
    from megatron.core.tensor_parallel import random as mcore_random

    # A device object, not the index 0: code inside an intercepted call (the whole backward pass
    # runs inside torch.autograd.backward) no longer sees the mode, and megatron's autograd
    # Functions allocate with device=torch.cuda.current_device().
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream, torch.cuda.Event = _NoStream, _NoEvent
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: _THE_STREAM
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.nvtx.range_push = torch.cuda.nvtx.range_pop = lambda *a, **k: None  # profiler ranges, no NVTX here
    torch.Tensor.record_stream = lambda tensor, stream: None  # one stream: no memory is reused too early
    torch.distributed.all_to_all_single = _all_to_all_single_taking_tensor_splits(torch.distributed.all_to_all_single)
    torch.distributed.all_gather = _all_gather_of_uneven_lengths(torch.distributed.all_gather)
    torch.distributed.all_gather_into_tensor = _all_gather_into_tensor_completed(
        torch.distributed.all_gather_into_tensor)
    fsdp_buffers._coalescing_manager = _coalescing_completed(torch.distributed._coalescing_manager)
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.random.get_rng_state = _cpu_get_rng_state
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which must stay untouched.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    # megatron's per-dropout warning, expected once the CUDA RNG maps onto the CPU one
    drop_messages(mcore_random.__name__, "CPU RNG state changed within GPU RNG context")

    _installed_mode = CudaToCpuMode()
    _installed_mode.__enter__()  # stays active for the life of the process
    return True
