"""torchrun worker: measure one rank's parameter, gradient-buffer, optimizer and activation bytes.

Builds the tiny model (configs/tiny.yaml + tests.launch.SMALL_MODEL + the overrides given on the
command line) with the recipe's own functions, optionally records the tensors autograd saves
for backward during the forward of one micro batch, runs one training step (megatron-core
schedule + optimizer step) on random tokens, and writes ``<out>/rank<R>.json``:

* ``params``: bytes of the unique storages behind the model parameters (the padded DDP param
  buffer under the distributed optimizer);
* ``grads``: bytes of the DDP gradient buffers (an MoE model's expert buffers included);
* ``optimizer``: bytes of the optimizer's own tensors (fp32 main params, Adam moments), that is
  every storage reachable from the torch optimizer that is not a model parameter or grad buffer,
  except torch Adam's 0-d ``step`` counters (4 bytes per tensor, not modelled by the planner);
* ``activations`` (with ``--activations``): bytes of the unique storages saved for backward
  during the forward of one micro batch through the whole rank (embedding, layers, loss),
  excluding parameter storages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_ext.config.schema import load_config
from megatron_ext.config.validate import validate_layout
from megatron_ext.distributed.parallel import destroy_distributed
from megatron_ext.training.micro_batch import forward_step
from megatron_ext.training.trainer import Trainer
from tests.launch import SMALL_MODEL, TINY

VOCAB = 1000  # not a multiple of 128: exercises the vocabulary padding


def worker_config(overrides: list[str]):
    """The tiny model under test: tiny.yaml, SMALL_MODEL, a fixed vocabulary, no outputs written."""
    return load_config(TINY, [*SMALL_MODEL, f"model.vocab_size={VOCAB}", "logging.tensorboard_dir=null",
                              "checkpoint.save=null", "model.attention_backend=local", "data.mock=true",
                              *overrides])


def random_batches(cfg, seed: int = 7) -> Iterator[dict[str, torch.Tensor]]:
    """The same random micro batch forever (identical on every rank, as TP/CP ranks need)."""
    gen = torch.Generator().manual_seed(seed)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=gen)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "loss_mask": torch.ones(b, s), "position_ids": torch.arange(s).repeat(b, 1)}
    while True:
        yield {k: v.clone() for k, v in batch.items()}


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _unique_bytes(tensors, exclude: set[int] = frozenset()) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        ptr, nbytes = _storage_key(t)
        if ptr not in exclude:
            seen[ptr] = nbytes
    return sum(seen.values())


def measure_activations(model: torch.nn.Module, batches, param_ptrs: set[int]) -> dict[str, Any]:
    """Bytes saved for backward by one micro batch's forward (embedding → layers → loss) on this rank."""
    saved: list[tuple[str, torch.Tensor]] = []
    active = ["loss"]  # innermost module running, so each saved tensor can be attributed

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((active[-1], t))
        return t

    names = {module: name for name, module in model.named_modules()}
    def enter(module: torch.nn.Module, _inputs) -> None:
        active.append(names[module])

    def leave(_module: torch.nn.Module, _inputs, _output) -> None:
        active.pop()

    handles = [m.register_forward_pre_hook(enter) for m in names]
    handles += [m.register_forward_hook(leave) for m in names]
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output, loss_func = forward_step(batches, model)
        loss_sum, _, _ = loss_func(output)
    for handle in handles:
        handle.remove()
    unique: dict[int, tuple[str, torch.Tensor]] = {}
    for where, t in saved:
        ptr, _ = _storage_key(t)
        if ptr not in param_ptrs:
            unique.setdefault(ptr, (where, t))
    detail = [(where, list(t.shape), str(t.dtype).replace("torch.", ""), t.untyped_storage().nbytes())
              for where, t in unique.values()]
    total = sum(nbytes for *_, nbytes in detail)
    saved.clear()  # (not `del`: the hook above closes over it)
    del loss_sum, output, unique
    return {"bytes": total, "tensors": detail}


def optimizer_bytes(optimizer, exclude: set[int]) -> int:
    """Storages the optimizer owns: main params and Adam moments (0-d step counters left out)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    tensors = []
    for opt in inner:
        torch_opt = opt.optimizer
        for group in torch_opt.param_groups:
            tensors.extend(group["params"])
        for state in torch_opt.state.values():
            tensors.extend(v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return _unique_bytes(tensors, exclude)


def _grad_buffers(model) -> list:
    """megatron-core DDP's parameter-and-gradient buffers: the dense ones and an MoE model's expert ones."""
    return [buf for chunk in model for buf in [*chunk.buffers, *chunk.expert_parallel_buffers]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--activations", action="store_true",
                        help="also measure the tensors one micro batch saves for backward")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = worker_config(args.overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_layout(cfg, world)

    # The recipe's own Trainer on mock data: model, DDP, optimizer and schedule hooks exactly as
    # in training (the optimizer allocates its state at the first step).
    trainer = Trainer(cfg)
    from megatron.core import parallel_state as ps

    model, optimizer = trainer.model, trainer.optimizer
    params = [p for chunk in model for p in chunk.parameters()]
    param_ptrs = {_storage_key(p)[0] for p in params}
    result: dict[str, Any] = {
        "rank": dist.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(), "cp_rank": ps.get_context_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "dp_cp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
        "expert_dp_rank": ps.get_expert_data_parallel_rank(),
        "params": _unique_bytes(params),
        "grads": _unique_bytes(buf.grad_data for buf in _grad_buffers(model)),
    }
    batches = random_batches(cfg)
    if args.activations:
        if len(model) != 1 or cfg.parallel.pipeline_model_parallel_size != 1:
            raise SystemExit("--activations measures a whole model on one rank: use PP=1")
        result["activations"] = measure_activations(model[0], batches, param_ptrs)

    data = [random_batches(cfg) for _ in model] if len(model) > 1 else batches
    trainer.train_step(data)
    grad_norm = trainer.pending.settle().steps[-1].grad_norm
    exclude = param_ptrs | {_storage_key(buf.grad_data)[0] for buf in _grad_buffers(model)}
    result["optimizer"] = optimizer_bytes(optimizer, exclude)
    result["grad_norm"] = grad_norm
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
