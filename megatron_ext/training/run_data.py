"""The run's data: its train/valid/test datasets, where in the training data it is (the samples consumed, moved past
the data skips recorded beside its checkpoints), and the iterators each model chunk reads."""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Optional

from megatron.core import parallel_state

from megatron_ext.checkpoint.data_skips import DataSkip, DataSkips
from megatron_ext.config.paths import blend_prefixes
from megatron_ext.config.schema import RecipeConfig
from megatron_ext.data.datasets import build_datasets, microbatch_iterator
from megatron_ext.data.tokenization_record import describe_blend, mixed_conventions

log = logging.getLogger("megatron_ext")

Batches = Iterator[dict]


class RunData:
    """Datasets, the training data's position and its iterators for one rank (`speak`: this rank logs)."""

    def __init__(self, cfg: RecipeConfig, tokenizer, num_chunks: int, dp_size: int, speak: bool):
        self.cfg, self.num_chunks, self.dp_size, self.speak = cfg, num_chunks, dp_size, speak
        self.eod = tokenizer.eod if cfg.data.reset_attention_mask else None  # document ids for the masking
        self.train, self.valid, self.test = build_datasets(cfg, tokenizer)
        self.skips = DataSkips(cfg.checkpoint.save)
        self.consumed_samples = 0
        self._training: Optional[list[Batches] | Batches] = None

    def say_how_it_was_tokenized(self) -> None:
        """The tokenizer each data prefix was prepared with, and a warning when they differ."""
        prefixes = [prefix for _, prefix in blend_prefixes(self.cfg)]
        described, mixed = describe_blend(prefixes), mixed_conventions(prefixes)
        if described and self.speak:
            log.info(described)
        if mixed and self.speak:
            log.warning(mixed)

    def iterators(self, dataset, consumed_samples: int = 0,
                  wrap: Callable[[Batches], Batches] = lambda it: it) -> list[Batches] | Batches:
        """One iterator per model chunk (the interleaved schedule reads each chunk's data separately) from sample
        `consumed_samples` of `dataset`, each through `wrap`."""
        t = self.cfg.train
        dp_rank = parallel_state.get_data_parallel_rank()
        its = [wrap(microbatch_iterator(dataset, consumed_samples, t.micro_batch_size, dp_rank, self.dp_size,
                                        self.cfg.data.num_workers, self.eod)) for _ in range(self.num_chunks)]
        return its[0] if len(its) == 1 else its

    def training_batches(self, wrap: Callable[[Batches], Batches]) -> list[Batches] | Batches:
        """The training iterators at the current position: the same ones until the position jumps (a data skip)."""
        if self._training is None:
            self._training = self.iterators(self.train, self.consumed_samples, wrap)
        return self._training

    def go_on(self, iteration: int, consumed_samples: int) -> None:
        """After `iteration`, with `consumed_samples` read: the position, past the data skips recorded there (each
        said in one line)."""
        position, applied = self.skips.position(iteration, consumed_samples)
        for skip in applied:
            if self.speak:
                log.info(f"data: after iteration {skip.iteration} the training data goes on at sample "
                         f"{skip.to_sample}, skipping samples {skip.from_sample}..{skip.to_sample - 1} "
                         f"({skip.reason or 'as recorded'} in {self.skips.path})")
        if position != consumed_samples:
            self._training = None  # not where the iterators are: new ones start at the position
        self.consumed_samples = position

    def step_done(self, iteration: int) -> None:
        """Step `iteration` read a global batch."""
        self.go_on(iteration, self.consumed_samples + self.cfg.train.global_batch_size)

    def skip_to(self, iteration: int, consumed_samples: int, to_sample: int, reason: str) -> None:
        """Collective: back at `iteration` with `consumed_samples` read (a rewind), the data goes on at `to_sample`;
        recorded for restarts."""
        self.skips.add(DataSkip(iteration, consumed_samples, to_sample, reason))
        self._training = None
        self.go_on(iteration, consumed_samples)
