"""torchrun worker: ring attention on zigzag chunks vs full causal attention on the whole sequence.

Every rank builds the same inputs and projection weights, computes the full-sequence reference
locally (torch SDPA, causal), then the CP version on its two chunks; weight gradients are summed
over the CP group. Rank 0 writes the worst relative differences per case to argv[1] as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.model.ring_attention import ring_attention


def zigzag(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst absolute difference, relative to the reference's largest magnitude."""
    return ((got - want).abs().max() / want.abs().max()).item()


def case(seq: int, heads: int, groups: int, rank: int, cp: int, group, value_dim: int = 8) -> dict[str, float]:
    """`value_dim` other than the query/key head size (8): multi-latent attention's values."""
    torch.manual_seed(seq * 100 + heads * 10 + groups)
    batch, hidden, dim = 2, 16, 8
    dims = {"q": dim, "k": dim, "v": value_dim}
    x_full = torch.randn(batch, seq, hidden, requires_grad=True)
    weights = {name: torch.randn(hidden, n * dims[name], requires_grad=True) / hidden ** 0.5
               for name, n in (("q", heads), ("k", groups), ("v", groups))}
    weights = {k: w.detach().requires_grad_() for k, w in weights.items()}
    probe = torch.randn(batch, heads, seq, value_dim)
    scale = dim ** -0.5

    def project(x, name, n):
        return (x @ weights[name]).view(batch, -1, n, dims[name]).transpose(1, 2)  # [b, n, s, d]

    ref = F.scaled_dot_product_attention(project(x_full, "q", heads), project(x_full, "k", groups),
                                         project(x_full, "v", groups), is_causal=True, scale=scale,
                                         enable_gqa=heads != groups)
    (ref * probe).sum().backward()
    ref_grads = {k: w.grad.clone() for k, w in weights.items()}
    for w in weights.values():
        w.grad = None

    x_local = zigzag(x_full.detach(), 1, rank, cp).requires_grad_()
    out = ring_attention(project(x_local, "q", heads), project(x_local, "k", groups),
                         project(x_local, "v", groups), scale, group, list(range(cp)))
    (out * zigzag(probe, 2, rank, cp)).sum().backward()
    diffs = {"output": relative(out, zigzag(ref.detach(), 2, rank, cp)),
             "input_grad": relative(x_local.grad, zigzag(x_full.grad, 1, rank, cp))}
    for name, w in weights.items():
        dist.all_reduce(w.grad, group=group)
        diffs[f"{name}_weight_grad"] = relative(w.grad, ref_grads[name])
    worst = torch.tensor(list(diffs.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(diffs, worst.tolist()))


def main() -> None:
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    results = {}
    for seq in (4 * cp, 8 * cp, 32 * cp):
        for heads, groups in ((4, 4), (4, 2), (4, 1)):
            results[f"cp{cp}_seq{seq}_heads{heads}_groups{groups}"] = case(seq, heads, groups, rank, cp, group)
        results[f"cp{cp}_seq{seq}_heads4_values_of_5_channels"] = case(seq, 4, 4, rank, cp, group, value_dim=5)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
