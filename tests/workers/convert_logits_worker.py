"""Our model's logits for saved checkpoints under chosen TP/PP layouts (a torchrun worker for test_convert).

    torchrun --nproc-per-node N -m tests.workers.convert_logits_worker JOBS.json

JOBS.json: ``{"tokens": "t.pt", "jobs": [{"checkpoint": DIR, "tp": 2, "pp": 2, "sp": true,
"output": "out.pt"}, ...]}`` (and ``"ep": 2`` for an MoE checkpoint's experts split over EP). Each job rebuilds
megatron-core's groups for its layout inside the one torchrun world, loads the checkpoint through dist_checkpointing
resharding, runs megatron-core's forward-only pipeline schedule and saves the unpadded full-vocabulary logits
[b, s, V] from the rank that holds them (last pipeline stage, TP rank 0, DP rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist


def megatron_logits(model, cfg, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Padded-vocab logits [b, s, padded] on last-stage ranks, None elsewhere (in model_parallel_world)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)

    def forward_step(data_iterator, chunk):
        output = chunk(next(data_iterator), positions, attention_mask=None)
        # forward-only with collect_non_loss_data: the schedule keeps what this returns.
        return output, lambda out, non_loss_data=False: out

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=model, num_microbatches=1,
            seq_length=seq, micro_batch_size=batch, forward_only=True, collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    (local,) = outputs  # [b, s, padded / TP]
    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return torch.cat(shards, dim=-1)


def checkpoint_logits(checkpoint: Path, tokens: torch.Tensor, tp: int = 1, pp: int = 1,
                      sp: bool = False, ep: int = 1) -> Optional[torch.Tensor]:
    """Unpadded logits [b, s, V] of `checkpoint`'s latest checkpoint at this layout; None off the holder."""
    from megatron.core import parallel_state

    from recipes.saved_model import build_model, layout_config, load_weights, model_parallel_world, read_checkpoint

    saved = read_checkpoint(Path(checkpoint))
    cfg = layout_config(saved, tp, pp, sp, ep)
    with model_parallel_world(cfg):
        model = build_model(cfg, saved.vocab_size, initialize=False)
        load_weights(model, saved)
        logits = megatron_logits(model, cfg, tokens)
        holder = (logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0
                  and parallel_state.get_data_parallel_rank() == 0)
    return logits[..., : saved.vocab_size] if holder else None


def checkpoint_greedy(checkpoint: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The tokens `checkpoint`'s model writes greedily after `prompt` (recipes.generate's loop, one process)."""
    from megatron_ext.model.generation import Sampling, generate
    from recipes.saved_model import build_model, layout_config, load_weights, model_parallel_world, read_checkpoint

    saved = read_checkpoint(Path(checkpoint))
    cfg = layout_config(saved)
    with model_parallel_world(cfg):
        model = build_model(cfg, saved.vocab_size, initialize=False)
        load_weights(model, saved)
        return generate(model.eval(), prompt, max_new_tokens, saved.vocab_size, cfg.model.seq_length, Sampling())


def main(jobs_file: str) -> int:
    spec = json.loads(Path(jobs_file).read_text())
    tokens = torch.load(spec["tokens"])
    for job in spec["jobs"]:
        logits = checkpoint_logits(Path(job["checkpoint"]), tokens, job["tp"], job["pp"], job["sp"], job.get("ep", 1))
        if logits is not None:
            torch.save(logits, job["output"])
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # guard required: dist_checkpointing may spawn helper processes
    sys.exit(main(sys.argv[1]))
