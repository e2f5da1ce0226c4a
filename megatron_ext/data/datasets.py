"""Train/valid/test data: megatron-core GPTDatasets from a weighted blend, and per-DP-rank microbatch iterators.

megatron-core builds the datasets (``BlendedMegatronDatasetBuilder``); the sampler that hands
each data-parallel rank its slice of every global batch, resumably from ``consumed_samples``,
lives in Megatron-LM's training package rather than in megatron-core, so it is written here.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.config.schema import RecipeConfig, object_storage_cache, parse_blend
from megatron_ext.data import object_storage

SCAN_CHUNK_TOKENS = 64 * 1024 * 1024  # the max-id scan reads the memmap in pieces, never all at once


def max_token_id(ds: IndexedDataset) -> int:
    """The largest token id in an indexed dataset (-1 when empty): one pass over its .bin."""
    from tqdm import tqdm

    count, itemsize = int(ds.sequence_lengths.sum(dtype=np.int64)), np.dtype(ds.index.dtype).itemsize
    if count == 0:
        return -1
    # a piece at a time: an object-storage reader returns what it reads in memory (a local one maps the file)
    return max(int(ds.bin_reader.read(dtype=ds.index.dtype, count=min(SCAN_CHUNK_TOKENS, count - first),
                                      offset=first * itemsize).max())
               for first in tqdm(range(0, count, SCAN_CHUNK_TOKENS), desc="scan ids", disable=None, leave=False))


def build_datasets(cfg: RecipeConfig, tokenizer: object
                   ) -> tuple[GPTDataset, Optional[GPTDataset], Optional[GPTDataset]]:
    """Train dataset sized for the whole run; validation and test (None where the split or blend has none) sized
    for one evaluation (the same batches each time)."""
    t, d = cfg.train, cfg.data
    eval_samples = t.eval_iters * t.global_batch_size
    sizes = [t.train_iters * t.global_batch_size, eval_samples, eval_samples]
    remote = object_storage.enable(cfg) is not None
    split_blends = [object_storage.as_read(parse_blend(b, f"data.{k}")) for k, b in
                    (("train_blend", d.train_blend), ("valid_blend", d.valid_blend), ("test_blend", d.test_blend))]
    per_split = any(split_blends) and not d.mock
    config = GPTDatasetConfig(
        random_seed=t.seed,
        sequence_length=cfg.model.seq_length,
        blend=None if per_split or d.mock else object_storage.as_read(parse_blend(d.blend, "data.blend")),
        blend_per_split=split_blends if per_split else None,
        split=None if per_split else d.split.replace("/", ","),  # mock: no blend at all → MockGPTDataset
        path_to_cache=d.path_to_cache,
        tokenizer=tokenizer,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        # no [s, s] mask: document masking reads document ids (microbatch_iterator), causal attention needs nothing
        create_attention_mask=False,
        # megatron-core reads object-storage data in ranges, without memory mapping (data/object_storage.py)
        mmap_bin_files=not remote,
        object_storage_cache_path=object_storage_cache(cfg) if remote else None,
    )
    dataset_class = MockGPTDataset if d.mock else GPTDataset
    train, valid, test = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()
    return train, valid, test


class DistributedBatchSampler(torch.utils.data.Sampler):
    """Yields this DP rank's micro batches of consecutive global batches, starting after `consumed_samples`.

    Sample order is independent of the DP size: the global batch i is samples
    [i·B, (i+1)·B) and DP rank r takes micro batches r, r+DP, ... of it in order, so every
    layout sees exactly the same data, and a resumed run continues with the next unseen sample.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int32: the number of EOD tokens before each token — the document each token is in, a document's EOD
    being its own last token (as megatron-core's reset_attention_mask draws the boundaries)."""
    ends = (tokens == eod).to(torch.int32)
    return torch.cumsum(ends, dim=1, dtype=torch.int32) - ends


class _WithDocumentIds:
    """DataLoader collate: the default one, plus each sequence's ``documents`` (:func:`document_ids`)."""

    def __init__(self, eod: int):
        self.eod = eod

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = torch.utils.data.default_collate(samples)
        batch["documents"] = document_ids(batch["tokens"], self.eod)
        return batch


def microbatch_iterator(dataset: GPTDataset, consumed_samples: int, micro_batch_size: int,
                        dp_rank: int, dp_size: int, num_workers: int, documents_eod: Optional[int] = None
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """Endless-enough iterator of this rank's micro batches (dicts of tokens/labels/loss_mask/position_ids, and
    with `documents_eod` the document ids that EOD token draws, for document masking)."""
    sampler = DistributedBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    # Its own generator: a DataLoader iterator otherwise draws its workers' base seed from the global RNG, so
    # every new iterator (at the start, at each evaluation) would shift the dropout masks after it, and a resumed
    # run (one iterator fewer) would not repeat the uninterrupted one.
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=None if documents_eod is None else _WithDocumentIds(documents_eod),
                                         pin_memory=torch.cuda.is_available(),
                                         persistent_workers=num_workers > 0, generator=torch.Generator())
    return iter(loader)
