"""A saved checkpoint's model in this process, for the converters and ``recipes.generate``: megatron-core's parallel
world (a gloo world of one, or torchrun's), the model built on the CPU (or the meta device), the checkpoint's config
and vocabulary, its weights loaded whole under any layout or read a group at a time
(:mod:`megatron_ext.convert.streaming`)."""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from megatron_ext.config.schema import RecipeConfig, config_defaults, without_retired_keys
from megatron_ext.errors import ConversionError
from megatron_ext.storage.files import AnyPath


@contextlib.contextmanager
def model_parallel_world(cfg: RecipeConfig) -> Iterator[None]:
    """megatron-core's groups for `cfg`'s layout: under torchrun its world, else a gloo world of one."""
    from megatron.core import parallel_state

    from megatron_ext.distributed import cpu_backend
    from megatron_ext.distributed.parallel import destroy_distributed, init_distributed

    own_world = "RANK" not in os.environ
    saved_env = dict(os.environ)  # init_distributed sets RANK/WORLD_SIZE/MASTER_* for a world of one
    cpu_backend.install()
    init_distributed(cfg, on_gpu=False)
    try:
        yield
    finally:
        if own_world:
            destroy_distributed()
            os.environ.clear()
            os.environ.update(saved_env)
        else:  # torchrun's process group stays for the caller's next layout
            parallel_state.destroy_model_parallel()


def build_model(cfg: RecipeConfig, vocab_size: int, initialize: bool = True):
    """This rank's GPTModel (one chunk, local layer spec, CPU) for `cfg`; inside model_parallel_world."""
    from megatron_ext.model.llama import build_model_chunks, transformer_config

    config = transformer_config(cfg, on_gpu=False, use_te=False)
    config.perform_initialization = initialize  # random init is wasted time when weights are copied in
    (model,) = build_model_chunks(cfg, vocab_size, config, use_te=False)
    return model.eval()


@dataclass
class SavedCheckpoint:
    """What export (or a logits check) needs to rebuild the model of a saved checkpoint."""

    iteration_dir: AnyPath
    cfg: RecipeConfig  # the run config saved with it
    vocab_size: int  # unpadded
    padded_vocab: int  # the embedding rows in the checkpoint
    content: str


def read_checkpoint(root: AnyPath) -> SavedCheckpoint:
    """The latest checkpoint under `root` (local, or in object storage): its saved config, vocabulary and padded embedding rows."""
    from megatron.core import dist_checkpointing
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_ext.checkpoint import fsdp_dtensor, layout, safe_unpickle
    from megatron_ext.checkpoint.common_state import read_common
    from megatron_ext.errors import CheckpointError

    iteration = layout.latest_iteration(root)
    if iteration is None:
        raise ConversionError(f"{root / layout.TRACKER} not found: {root} is not a checkpoint "
                              "directory of this recipe")
    directory = layout.iteration_dir(root, iteration)
    if not directory.is_dir():
        raise ConversionError(f"{directory} not found (named by {root / layout.TRACKER})")
    try:
        common = read_common(directory)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(config_defaults(), without_retired_keys(common.config)))
    except OmegaConfBaseException as e:
        raise ConversionError(f"{directory}: saved config: {e.full_key}: {e.msg}") from None
    if fsdp_dtensor.holds_format(directory):
        rows = fsdp_dtensor.embedding_rows(directory)
    else:
        with safe_unpickle.refusals_named(directory):
            embedding = dist_checkpointing.load_tensors_metadata(str(directory)).get("embedding.word_embeddings.weight")
        if embedding is None:
            raise ConversionError(f"{directory}: no embedding.word_embeddings.weight tensor in the checkpoint")
        rows = int(embedding.global_shape[0])
    vocab = cfg.model.vocab_size
    if vocab is None:  # the run used its tokenizer's vocabulary
        path = cfg.data.tokenizer_model
        if not path or not Path(path).exists():
            raise ConversionError(f"{directory}: model.vocab_size is not in the saved config and its "
                                  f"data.tokenizer_model={path!r} does not exist: the unpadded vocabulary "
                                  "is unknown")
        from megatron_ext.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(path, cfg.data.tokenizer_type).vocab_size
    return SavedCheckpoint(directory, cfg, vocab, rows, common.content)


def layout_config(saved: SavedCheckpoint, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                  sequence_parallel: bool = False, expert_parallel: int = 1) -> RecipeConfig:
    """The saved run config under another layout, padding the vocabulary to the checkpoint's rows."""
    if saved.padded_vocab % tensor_parallel:
        raise ConversionError(f"{saved.iteration_dir}: {saved.padded_vocab} embedding rows cannot be split "
                              f"over tensor_model_parallel_size={tensor_parallel}")
    cfg = copy.deepcopy(saved.cfg)
    cfg.model.make_vocab_size_divisible_by = saved.padded_vocab // tensor_parallel
    cfg.model.attention_backend = "local"
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tensor_parallel, pipeline_parallel
    p.sequence_parallel = sequence_parallel
    p.expert_model_parallel_size, p.expert_tensor_parallel_size = expert_parallel, None
    p.use_megatron_fsdp = False
    p.virtual_pipeline_model_parallel_size = None
    p.context_parallel_size = 1
    p.num_layers_in_first_pipeline_stage = p.num_layers_in_last_pipeline_stage = None
    cfg.train.recompute_granularity = None
    return cfg


def load_weights(model, saved: SavedCheckpoint) -> None:
    """The saved weights into `model`, resharded by dist_checkpointing (or DCP) to the current layout."""
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_ext.checkpoint import fsdp_dtensor, safe_unpickle

    if fsdp_dtensor.holds_format(saved.iteration_dir):
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            raise ConversionError(f"{saved.iteration_dir} is a Megatron-FSDP checkpoint: it loads here at "
                                  "tensor_model_parallel_size=1 only")
        fsdp_dtensor.load_weights_into(model, saved.iteration_dir)
        return
    with safe_unpickle.refusals_named(saved.iteration_dir):
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(saved.iteration_dir))
    model.load_state_dict(loaded["model"])


def weights_by_group(cfg: RecipeConfig, saved: SavedCheckpoint, wanted: Callable[[list[str]], bool]
                             ) -> Iterator[dict[str, torch.Tensor]]:
    """The saved weights as the one-process model holds them, a group at a time (the embedding, output layer and
    final norm, then each layer: :mod:`megatron_ext.convert.streaming`), the groups whose names are `wanted` — or
    all at once from a Megatron-FSDP checkpoint, or one whose keys the model no longer names (read by the full load's
    repairs)."""
    from megatron_ext.checkpoint import fsdp_dtensor, safe_unpickle
    from megatron_ext.convert import streaming

    with torch.device("meta"):
        meta = build_model(cfg, saved.vocab_size, initialize=False)
    sharded = meta.sharded_state_dict()
    grouped = streaming.groups(sharded)
    safe_unpickle.install()  # torch's reader unpickles the metadata: only what a checkpoint of this recipe holds
    if fsdp_dtensor.holds_format(saved.iteration_dir) or not streaming.keys_of(sharded) <= guarded(
            streaming.stored_keys, saved):
        print(f"reading {saved.iteration_dir} whole (a Megatron-FSDP checkpoint, or keys of an older layout): the "
              "model's weights are held at once")
        model = build_model(cfg, saved.vocab_size, initialize=False)
        load_weights(model, saved)
        yield model.state_dict()
        return
    print(f"reading {saved.iteration_dir} a group at a time: {streaming.GLOBALS}, then {len(grouped) - 1} layers")
    for names in grouped.values():
        if wanted(names):
            yield guarded(streaming.read_group, saved, sharded, names)


def guarded(read, saved: SavedCheckpoint, *args):
    """`read(*args, iteration_dir)` with a refused unpickling said as one CheckpointError naming the checkpoint."""
    from megatron_ext.checkpoint import safe_unpickle

    with safe_unpickle.refusals_named(saved.iteration_dir):
        return read(*args, saved.iteration_dir)
