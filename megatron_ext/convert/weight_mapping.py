"""How one megatron-core tensor is made of Hugging Face tensors, in both directions, and the vocabulary padding and
sequence length an imported checkpoint's recipe gets. Megatron names are those of the TP1/PP1 local-spec GPTModel's state dict (dist_checkpointing
reshards it to any layout); each family (:mod:`megatron_ext.convert.families`) lists its mappings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Literal, Mapping, Optional

import torch

# The TP sizes an imported checkpoint loads under without re-importing (see vocab_padding).
PORTABLE_TP = 8
# Imported recipes train at most this many tokens per sample by default (override model.seq_length).
SEQ_LENGTH_CAP = 4096

# direct: the same tensor; vocab_rows: padded rows; qkv / gate_up: fused along rows. The stacked kinds take one
# expert's row `expert` of a Hugging Face tensor that stacks all of a layer's experts (GPT-OSS's [experts, in, out]
# weights, applied as x @ w): stacked as it is, stacked_t transposed to megatron's [out, in], stacked_glu with its
# interleaved gate/up columns (gate even, up odd) regrouped as megatron's [gate; up] (and transposed, for a weight)
WeightKind = Literal["direct", "vocab_rows", "qkv", "gate_up", "stacked", "stacked_t", "stacked_glu"]
STACKED_KINDS = ("stacked", "stacked_t", "stacked_glu")


@dataclass(frozen=True)
class WeightMapping:
    """One megatron tensor and the Hugging Face tensors it is made of, and how."""

    megatron: str
    hf: tuple[str, ...]
    kind: WeightKind
    expert: int = 0  # a stacked kind's row: the expert

    def format(self, **indices: int) -> WeightMapping:
        """This mapping for one layer ``{i}`` (and expert ``{e}``)."""
        return WeightMapping(self.megatron.format(**indices), tuple(n.format(**indices) for n in self.hf), self.kind,
                             indices.get("e", 0) if self.kind in STACKED_KINDS else 0)


def _from_stacked(row: torch.Tensor, kind: WeightKind) -> torch.Tensor:
    if kind == "stacked_glu":
        row = torch.cat([row[..., ::2], row[..., 1::2]], dim=-1)
    return row.t() if kind != "stacked" and row.dim() == 2 else row


def _to_stacked(tensor: torch.Tensor, kind: WeightKind) -> torch.Tensor:
    row = tensor.t() if kind != "stacked" and tensor.dim() == 2 else tensor
    if kind == "stacked_glu":  # [..., gate | up] → gate and up columns alternating
        row = torch.stack(torch.chunk(row, 2, dim=-1), dim=-1).flatten(-2)
    return row


def vocab_padding(vocab_size: int, tensor_parallel_size: int) -> tuple[int, int]:
    """(make_vocab_size_divisible_by, padded rows) giving the same padded rows at TP 1, 2, 4, 8 and `tp`.

    Megatron pads to a multiple of ``m × TP``. With ``L = lcm(8, tp)`` and ``m = ceil(V / L)`` the
    padded size is ``L·m`` for every TP dividing L (it is ≤ L-1 rows past V), so one imported
    checkpoint loads under all of them. Only for tiny vocabularies (``(L-1)·m ≥ V``) does that
    fail; then fall back to megatron's usual 128 × tp, which fixes the checkpoint to this TP.
    """
    lcm = math.lcm(PORTABLE_TP, tensor_parallel_size)
    divisor = math.ceil(vocab_size / lcm)
    if (lcm - 1) * divisor < vocab_size:
        return divisor, lcm * divisor
    multiple = 128 * tensor_parallel_size
    return 128, multiple * math.ceil(vocab_size / multiple)


QKVCodec = tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]  # (fuse, split)


def hf_to_megatron(get: Callable[[str], torch.Tensor], mappings: Iterable[WeightMapping], padded_vocab: int,
                   qkv: Optional[QKVCodec] = None,
                   get_row: Optional[Callable[[str, int], torch.Tensor]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, tensor) pairs, produced one mapping at a time so memory stays near one model (``qkv``: the
    family's fusion of separate q, k, v projections; ``get_row``: one row of a stacked tensor, read alone)."""
    get_row = get_row or (lambda name, row: get(name)[row])
    for m in mappings:
        if m.kind in STACKED_KINDS:
            yield m.megatron, _from_stacked(get_row(m.hf[0], m.expert), m.kind)
            continue
        parts = [get(name) for name in m.hf]
        if m.kind == "vocab_rows":  # zero rows: no token looks them up, their logits start at 0 (as Megatron-LM pads)
            tensor = torch.cat([parts[0], parts[0].new_zeros(padded_vocab - parts[0].size(0), parts[0].size(1))])
        elif m.kind == "qkv":
            assert qkv is not None, m
            tensor = qkv[0](*parts)
        else:  # direct, or gate_up: [gate; up]
            tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
        yield m.megatron, tensor


def megatron_to_hf(state: Mapping[str, torch.Tensor], mappings: Iterable[WeightMapping], vocab_size: int,
                   qkv: Optional[QKVCodec] = None) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (padding rows dropped), each contiguous and owning its memory for safetensors."""
    out: dict[str, torch.Tensor] = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}  # a stacked tensor's rows, by expert
    for m in mappings:
        tensor = state[m.megatron]
        if m.kind in STACKED_KINDS:
            rows.setdefault(m.hf[0], {})[m.expert] = _to_stacked(tensor, m.kind)
            continue
        if m.kind == "vocab_rows":
            parts: tuple[torch.Tensor, ...] = (tensor[:vocab_size],)
        elif m.kind == "qkv":
            assert qkv is not None, m
            parts = qkv[1](tensor)
        elif m.kind == "gate_up":
            parts = tuple(torch.chunk(tensor, 2, dim=0))
        else:
            parts = (tensor,)
        out.update(zip(m.hf, parts))
    out.update({name: torch.stack([by_expert[e] for e in sorted(by_expert)]) for name, by_expert in rows.items()})
    return {name: t.detach().contiguous().clone() for name, t in out.items()}
