"""Hugging Face Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3 (Kimi K2) and GPT-OSS checkpoints in and out of the recipe's
dist_checkpointing format.

    python -m recipes.convert import-hf --hf-dir DIR --output CKPT_DIR [--workers N] \\
        [--tensor-model-parallel-size N] [--pipeline-model-parallel-size M] [--expert-model-parallel-size E]
    python -m recipes.convert export-hf --checkpoint CKPT_DIR --output DIR [--workers N] [--max-shard-size 5GB]
        [--msc-config FILE: CKPT_DIR in object storage, msc://PROFILE/prefix]

import-hf writes a weights-only checkpoint (iteration 0) plus ``CKPT_DIR/recipe.yaml``, a continued-pretraining
recipe that starts from those weights (``checkpoint.pretrained_checkpoint``) and resumes from its own
``checkpoint.save`` when relaunched; train it with ``--config CKPT_DIR/recipe.yaml data.blend=[PREFIX]`` under any
TP/PP/EP layout. export-hf reads a checkpoint saved under any layout (imported or trained) and writes
config.json + model.safetensors (+ the tokenizer: tokenizer.model, or a Hugging Face tokenizer.json +
tokenizer_config.json) for ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``, in shards of at most
``--max-shard-size`` with an index, as transformers writes them.
Both convert a group at a time (the embedding, output layer and final norm, then each layer): a model far larger
than this machine's memory converts; ``--workers N`` runs N processes, each converting its share of the groups.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.config.shape import ModelShape, padded_vocab_size
from megatron_ext.config.validate import validate_layout
from megatron_ext.convert import families
from megatron_ext.convert.cost import export_cost, import_cost, streamed_parameters
from megatron_ext.convert.hf_files import (
    DEFAULT_MAX_SHARD_SIZE,
    ShardWriter,
    check_tensors,
    progress_line,
    shard_size_bytes,
)
from megatron_ext.convert.weight_mapping import hf_to_megatron, megatron_to_hf, vocab_padding
from megatron_ext.errors import ConfigError, ConversionError, RecipeError
from megatron_ext.storage import files
from recipes.saved_model import (
    SavedCheckpoint,
    build_model,
    layout_config,
    model_parallel_world,
    read_checkpoint,
    weights_by_group,
)

_PRECISIONS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# What an imported recipe trains with: continued pretraining of an already trained model, so a peak LR a tenth of
# Llama 3's pretraining peak (3e-4), re-warmed over 5 % of the run so the fresh Adam moments settle before it,
# and a cosine decay to a tenth of that. Batch and length are starting points; recipes.plan sizes the layout.
CONTINUED_PRETRAINING = {
    "train.train_iters": 2000, "train.global_batch_size": 128, "train.micro_batch_size": 1,
    "train.eval_interval": 200, "optimizer.lr": 3.0e-5, "optimizer.min_lr": 3.0e-6,
    "optimizer.lr_warmup_iters": 100, "optimizer.lr_decay_style": "cosine",
    "checkpoint.save_interval": 500, "checkpoint.keep_last": 2,
}


# ---------------------------------------------------------------------------------------------
# Output directories


@contextlib.contextmanager
def _staged(output: Path) -> Iterator[Path]:
    """A temporary sibling of `output`, renamed to it only when everything was written."""
    if output.exists():
        raise ConversionError(f"{output} already exists; choose a new output directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        yield staging
        # mkdtemp (0700) and safetensors (0600) create private modes; publish with the usual ones.
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)
        for path in staging.rglob("*"):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        os.replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _sentencepiece_vocab(path: Path) -> int:
    import sentencepiece as spm

    try:
        return spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()
    except (RuntimeError, OSError) as e:
        raise ConversionError(f"{path}: not a sentencepiece model ({e})") from None


# ---------------------------------------------------------------------------------------------
# import-hf


def import_hf(hf_dir: Path, output: Path, tensor_parallel: int = 1, pipeline_parallel: int = 1,
              expert_parallel: int = 1, workers: int = 1) -> Path:
    """Hugging Face Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3 or GPT-OSS directory → weights-only dist checkpoint +
    recipe.yaml at `output` (its layout: TP × PP, and for MoE models EP, over TP·PP·EP GPUs), converted and written a
    layer at a time; by `workers` processes, each converting every `workers`-th layer."""
    hf_dir, output = Path(hf_dir), Path(output).absolute()
    if not hf_dir.is_dir():
        raise ConversionError(f"{hf_dir} is not a directory")
    shape, reader = families.read_hf_dir(hf_dir)
    family = families.family_of(shape)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if shape.tied else {}  # transformers may save it
    dtype = check_tensors(reader, family.hf_shapes(shape), {**family.tensor_copies(shape), **tied},
                          hf_dir / "config.json", f"a {shape.num_layers}-layer {shape.architecture}")
    if dtype == torch.float16:  # the recipe trains in fp32 or bf16; widening fp16 is exact
        print(f"note: {hf_dir} holds float16 weights; importing them as float32 (exact)", file=sys.stderr)
        dtype = torch.float32

    cfg = RecipeConfig()
    cfg.recipe.name = f"{hf_dir.name}-continued"
    cfg.recipe.description = (f"continued pretraining of the {shape.architecture} imported from "
                              f"{hf_dir.absolute()}")
    for key, value in family.recipe_model_fields(shape, tensor_parallel).items():
        setattr(cfg.model, key, value)
    cfg.parallel.tensor_model_parallel_size = tensor_parallel
    cfg.parallel.pipeline_model_parallel_size = pipeline_parallel
    cfg.parallel.sequence_parallel = tensor_parallel > 1
    cfg.parallel.expert_model_parallel_size = expert_parallel
    cfg.recipe.gpus = tensor_parallel * pipeline_parallel * expert_parallel
    cfg.train.precision = _PRECISIONS[dtype]
    for key, value in CONTINUED_PRETRAINING.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    # The first launch starts from the imported weights; every later one (a relaunch, a requeue) resumes from
    # its own checkpoint.save, which checkpoint.load (auto) points at.
    cfg.checkpoint.pretrained_checkpoint = str(output)
    cfg.checkpoint.save = f"runs/{cfg.recipe.name}/checkpoints"
    cfg.logging.tensorboard_dir = f"runs/{cfg.recipe.name}/tensorboard"
    # sentencepiece where the directory has one (Llama 2: its tokenizer.json is a conversion of it), else the
    # Hugging Face tokenizer.json (Llama 3), copied into the checkpoint and recorded in its config
    tokenizer = hf_dir / "tokenizer.model"
    if not tokenizer.is_file() and (hf_dir / "tokenizer.json").is_file():
        tokenizer = hf_dir
    if tokenizer.is_file():
        cfg.data.tokenizer_model = str(output / "tokenizer.model")
        if _sentencepiece_vocab(tokenizer) > shape.vocab_size:
            raise ConversionError(f"{tokenizer} has more pieces than {hf_dir / 'config.json'} vocab_size="
                                  f"{shape.vocab_size}")
    elif tokenizer == hf_dir:
        from megatron_ext.data.tokenizer import HUGGING_FACE, HuggingFaceTokenizer
        from megatron_ext.errors import TokenizerError

        try:
            hf_vocab = HuggingFaceTokenizer(str(hf_dir)).vocab_size
        except TokenizerError as e:
            raise ConversionError(str(e)) from None
        if hf_vocab > shape.vocab_size:
            raise ConversionError(f"{hf_dir / 'tokenizer.json'} has {hf_vocab} tokens, more than "
                                  f"{hf_dir / 'config.json'} vocab_size={shape.vocab_size}")
        cfg.data.tokenizer_model, cfg.data.tokenizer_type = str(output / "tokenizer"), HUGGING_FACE
    try:  # the layout the recipe.yaml names must be a valid one for this model
        validate_layout(cfg, world_size=cfg.recipe.gpus)
    except ConfigError as e:
        raise ConversionError(f"--tensor/pipeline/expert-model-parallel-size for this model: {e}") from None

    model_shape = ModelShape.of(cfg.model)
    cost = import_cost(reader.files.values(), model_shape.num_parameters(shape.vocab_size),
                       *streamed_parameters(model_shape, shape.vocab_size),
                       model_shape.num_layers + model_shape.mtp_num_layers, dtype.itemsize, output)
    free = cost.free_bytes()
    cost.check_disk(free)
    print(cost.describe(free) + "; converted and written a layer at a time" +
          (f" by {workers} processes, each converting one layer in {workers}" if workers > 1 else ""))

    from omegaconf import OmegaConf  # after the checks: bad inputs fail in a second

    # Built at TP1/PP1 with the padded rows the recipe will build at `tensor_parallel`.
    build_cfg = copy.deepcopy(cfg)
    divisor, padded = vocab_padding(shape.vocab_size, tensor_parallel)
    portable = sorted({tp for tp in (1, 2, 4, 8, tensor_parallel)
                       if padded_vocab_size(shape.vocab_size, divisor, tp) == padded})
    build_cfg.model.make_vocab_size_divisible_by = padded
    build_cfg.parallel = type(cfg.parallel)()
    with _staged(output) as staging:
        if workers == 1:
            _import_share(hf_dir, staging, build_cfg, cfg.to_dict(), 0, 1)
        else:  # forked (see export_hf), in a gloo world of their own: megatron-core's save gathers every process's plan
            from megatron_ext.distributed.parallel import free_port
            from recipes.convert import _import_share as share  # by its module's name, also when run as __main__

            world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(workers)}
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                list(pool.map(share, *zip(*[(hf_dir, staging, build_cfg, cfg.to_dict(), w, workers, world)
                                            for w in range(workers)])))
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, staging / "tokenizer.model")
        elif tokenizer == hf_dir:
            _copy_hf_tokenizer(hf_dir, staging / "tokenizer")
        header = (f"# Imported from {hf_dir.absolute()} by `python -m recipes.convert import-hf`: continued\n"
                  f"# pretraining from its weights (checkpoint.pretrained_checkpoint), with its own tokenizer and\n"
                  f"# sequence length, re-warmed LR a tenth of pretraining's. Train (a relaunch resumes):\n"
                  f"# python -m recipes.launch --nproc-per-node {cfg.recipe.gpus} "
                  f"--config {output / 'recipe.yaml'} data.blend=[PREFIX]"
                  f"{'' if cfg.data.tokenizer_model else ' data.tokenizer_model=TOKENIZER.model'}\n"
                  f"# Its {padded} embedding rows (vocab {shape.vocab_size} + padding) load under TP sizes "
                  f"{', '.join(map(str, portable))}: model.make_vocab_size_divisible_by is chosen for that; "
                  "other TP sizes need a re-import with --tensor-model-parallel-size.\n")
        (staging / "recipe.yaml").write_text(header + OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return output


# ---------------------------------------------------------------------------------------------
# export-hf


def _import_share(hf_dir: Path, staging: Path, build_cfg: RecipeConfig, run_config: dict[str, Any], worker: int,
                  workers: int, world: Optional[dict[str, str]] = None) -> None:
    """Write the `worker`-th of `workers` shares of the imported checkpoint into `staging` (every `workers`-th group:
    the embedding, output layer and final norm, then each layer), converting each tensor from the Hugging Face files
    when torch's checkpoint writer reaches it (:class:`megatron_ext.convert.streaming.StreamingSave`); `world`: the
    rendezvous of the `workers` processes."""
    from megatron_ext.checkpoint import save_load
    from megatron_ext.convert import streaming

    shape, reader = families.read_hf_dir(hf_dir)
    family = families.family_of(shape)
    mappings = {m.megatron: m for m in family.weight_mappings(shape)}
    padded = build_cfg.model.make_vocab_size_divisible_by
    if world is not None:
        os.environ.update(world, RANK=str(worker), LOCAL_RANK=str(worker))
    with model_parallel_world(build_cfg):
        with torch.device("meta"):
            meta = build_model(build_cfg, shape.vocab_size, initialize=False)
        sharded = meta.sharded_state_dict()
        grouped = streaming.groups(sharded)
        unmapped = set().union(*grouped.values()) ^ set(mappings)
        if unmapped:
            raise RuntimeError(f"weight mapping bug: the model's and the mappings' weights differ: {sorted(unmapped)}")
        mine = [name for number, names in enumerate(grouped.values()) if number % workers == worker for name in names]
        share = {name: item for name, item in sharded.items() if name not in mappings}  # megatron-core's own objects
        for name in mine:
            share[name] = copy.copy(sharded[name])
            share[name].replica_id = 0  # this process alone writes it

        reading, done, started = "", 0, time.monotonic()

        def group_done() -> None:  # its pages of the Hugging Face files let go, and a line of progress
            nonlocal done
            reader.release()
            done += 1
            print(progress_line(f"converted {reading}", done, len(range(worker, len(grouped), workers)), started),
                  flush=True)

        def converted(name: str) -> torch.Tensor:
            nonlocal reading
            if streaming.group_of(name) != reading:
                if reading:
                    group_done()
                reading = streaming.group_of(name)
            expected = sharded[name].data
            ((_, tensor),) = hf_to_megatron(reader.get, [mappings[name]], padded, family.qkv_codec(shape),
                                            reader.get_row)
            if tensor.shape != expected.shape:
                raise RuntimeError(f"weight mapping bug: {name} {tuple(tensor.shape)} does not fit "
                                   f"{tuple(expected.shape)}")
            return tensor.to(expected.dtype)

        save_load.save_weights_only(staging, share, run_config,
                                    streaming.StreamingSave(streaming.TensorSource(sharded, mine, converted)))
        if reading:  # a worker beyond the number of groups converted none
            group_done()


def _write_tokenizer(source: Path, output: Path, seq_length: int) -> tuple[Optional[int], Optional[int]]:
    """tokenizer.model + a minimal tokenizer_config.json for LlamaTokenizer; returns (bos, eos) ids."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(source))
    shutil.copyfile(source, output / "tokenizer.model")

    def piece(i: int) -> Optional[str]:
        return sp.id_to_piece(i) if i >= 0 else None

    bos, eos = sp.bos_id(), sp.eos_id()
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": piece(bos), "eos_token": piece(eos), "unk_token": piece(sp.unk_id()),
        "pad_token": piece(sp.pad_id()),
        # The recipe tokenizes without BOS/EOS (documents are separated by EOD = EOS in the data).
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": seq_length,
        "clean_up_tokenization_spaces": False,
    }
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return (bos if bos >= 0 else None), (eos if eos >= 0 else None)


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy_hf_tokenizer(source: Path, output: Path) -> tuple[Optional[int], Optional[int]]:
    """A Hugging Face tokenizer directory's files into `output` (created); returns its (bos, eos) ids."""
    from megatron_ext.data.tokenizer import HuggingFaceTokenizer

    output.mkdir(parents=True, exist_ok=True)
    for name in HF_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, output / name)
    tokenizer = HuggingFaceTokenizer(str(source))
    return tokenizer.bos, tokenizer.eos


def export_hf(checkpoint: str | Path, output: Path, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
              workers: int = 1) -> Path:
    """Latest checkpoint under `checkpoint` (any layout; local, or in object storage once :func:`files.enable` named
    its configuration) → Hugging Face directory at `output`: Llama, or with
    qk_layernorm Qwen3; an MoE model as Mixtral, or with qk_layernorm Qwen3-MoE; with multi-latent attention
    DeepSeek-V3; with learnable attention sinks GPT-OSS — in safetensors shards of at most `max_shard_size`
    (transformers' form, one file when it fits), read and written a layer at a time; by `workers` processes, each
    writing every `workers`-th shard (reading the layers those need)."""
    checkpoint, output = str(checkpoint), Path(output).absolute()  # a string: msc:// stays whole, workers get it
    shard_bytes = shard_size_bytes(max_shard_size)
    saved, cfg, shape, dtype = _exported(checkpoint)
    tokenizer = Path(cfg.data.tokenizer_model) if cfg.data.tokenizer_model else None
    if tokenizer is not None and not tokenizer.exists():
        print(f"warning: data.tokenizer_model={tokenizer} of the saved config does not exist; "
              "exporting without a tokenizer", file=sys.stderr)
        tokenizer = None
    model_shape = ModelShape.of(cfg.model)
    copied = 2 * model_shape.mtp_num_layers * shape.vocab_size * model_shape.hidden_size
    cost = export_cost(model_shape.num_parameters(shape.vocab_size), copied, dtype.itemsize, shard_bytes, output,
                       *streamed_parameters(model_shape, shape.vocab_size))
    free = cost.free_bytes()
    cost.check_disk(free)
    print(cost.describe(free) + (f"; {workers} processes, each writing one shard in {workers}" if workers > 1 else ""))
    family = families.family_of(shape)
    with _staged(output) as staging:
        if workers == 1:
            _export_share(checkpoint, staging, max_shard_size, 0, 1)
        else:  # forked before any process group or thread exists: spawned, each would import torch and megatron-core
            # again (3-4 s on a small host, more than the conversion of a 1.6 GB model); each builds its model in a
            # world of its own, which patches torch on CPU for its process
            from recipes.convert import _export_share as share  # by its module's name, also when run as __main__

            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                list(pool.map(share, *zip(*[(checkpoint, staging, max_shard_size, w, workers) for w in range(workers)])))
            _shard_writer(family, shape, dtype, staging, max_shard_size).write_index()
        bos = eos = None
        if tokenizer is not None and tokenizer.is_dir():
            bos, eos = _copy_hf_tokenizer(tokenizer, staging)
        elif tokenizer is not None:
            bos, eos = _write_tokenizer(tokenizer, staging, cfg.model.seq_length)
        config = family.hf_config(shape, dtype, bos, eos)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return output


def _exported(checkpoint: str) -> tuple[SavedCheckpoint, RecipeConfig, Any, torch.dtype]:
    """The checkpoint to export, its config as one process builds it, the Hugging Face shape and the dtype."""
    from megatron_ext.model.llama import PARAMETER_DTYPES

    saved = read_checkpoint(files.at(checkpoint))
    cfg = layout_config(saved)
    try:
        shape = families.shape_from_recipe(cfg, saved.vocab_size)
    except ConversionError as e:
        raise ConversionError(f"{saved.iteration_dir}: {e}") from None
    if saved.vocab_size > saved.padded_vocab:
        raise ConversionError(f"{saved.iteration_dir}: vocabulary {saved.vocab_size} exceeds the "
                              f"{saved.padded_vocab} embedding rows")
    return saved, cfg, shape, PARAMETER_DTYPES[cfg.train.precision]


def _shard_writer(family: Any, shape: Any, dtype: torch.dtype, staging: Path, max_shard_size: str,
                  share: tuple[int, int] = (0, 1)) -> ShardWriter:
    """The Hugging Face files' writer, its shards planned from every tensor's name, shape and dtype."""
    hf_shapes, copies = family.hf_shapes(shape), family.tensor_copies(shape)
    return ShardWriter({name: (dims, dtype) for name, dims in {
        **hf_shapes, **{duplicate: hf_shapes[source] for duplicate, source in copies.items()}}.items()}, staging,
        max_shard_size, share=share)


def _export_share(checkpoint: str, staging: Path, max_shard_size: str, worker: int, workers: int) -> None:
    """Write the `worker`-th of `workers` shares of the Hugging Face shards into `staging`, reading only the groups
    of weights (:func:`_megatron_state_by_group`) that feed them."""
    from megatron_ext.checkpoint.model_class import gpt_parameter_name
    from megatron_ext.model.hybrid import is_hybrid

    saved, cfg, shape, dtype = _exported(checkpoint)
    family = families.family_of(shape)
    copies = family.tensor_copies(shape)
    writer = _shard_writer(family, shape, dtype, staging, max_shard_size, (worker, workers))
    hybrid = is_hybrid(cfg)
    with model_parallel_world(cfg):
        mappings = list(family.weight_mappings(shape))
        # the mappings name GPTModel's parameters: a HybridModel's renamed (checkpoint/model_class.py)
        outputs = {m.megatron: [*m.hf, *(d for d, source in copies.items() if source in m.hf)] for m in mappings}

        def wanted(names: list[str]) -> bool:
            return any(writer.wants(hf) for name in names for hf in outputs.get(gpt_parameter_name(name, hybrid), ()))

        for state in weights_by_group(cfg, saved, wanted):
            state = {gpt_parameter_name(name, hybrid): tensor for name, tensor in state.items()}
            ready = [m for m in mappings if m.megatron in state]
            for name, tensor in megatron_to_hf(state, ready, shape.vocab_size, family.qkv_codec(shape)).items():
                writer.add(name, tensor)
                for duplicate in (duplicate for duplicate, source in copies.items() if source == name):
                    writer.add(duplicate, tensor.clone())
            del state
    writer.finish()


# ---------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipes.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import-hf", help="Hugging Face Llama, Qwen3, Mixtral or Qwen3-MoE directory → dist "
                                                   "checkpoint + recipe.yaml")
    imp.add_argument("--hf-dir", type=Path, required=True, help="has config.json and *.safetensors")
    imp.add_argument("--output", type=Path, required=True, help="new checkpoint directory")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP of recipe.yaml")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP of recipe.yaml")
    imp.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP of recipe.yaml (MoE models)")
    imp.add_argument("--workers", type=int, default=1,
                     help="processes converting at once, each writing every Nth layer (default 1)")
    exp = sub.add_parser("export-hf", help="dist checkpoint (any layout) → Hugging Face Llama, Qwen3, Mixtral or "
                                                   "Qwen3-MoE directory")
    exp.add_argument("--checkpoint", required=True,
                     help="checkpoint root (has the tracker file): local, or msc://PROFILE/prefix with --msc-config")
    exp.add_argument("--msc-config", help="multi-storage-client's configuration (the run's storage.msc_config), for "
                                          "a checkpoint in object storage")
    exp.add_argument("--output", type=Path, required=True, help="new Hugging Face model directory")
    exp.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                     help="largest safetensors file, in transformers' size strings (5GB, 100KB; default "
                          f"{DEFAULT_MAX_SHARD_SIZE}): model-0000k-of-0000n.safetensors with an index beyond it")
    exp.add_argument("--workers", type=int, default=1,
                     help="processes converting at once, each writing every Nth shard (default 1)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    # megatron-core/torch deprecation notices about their own internals: noise for a converter's user.
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank would write its own copy
            raise ConversionError("run `python -m recipes.convert` as one process, not under torchrun")
        for flag in ("workers", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size"):  # the last three: import-hf's
            if getattr(args, flag, 1) < 1:
                raise ConversionError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
        if args.command == "import-hf":
            out = import_hf(args.hf_dir, args.output, args.tensor_model_parallel_size,
                            args.pipeline_model_parallel_size, args.expert_model_parallel_size, args.workers)
            print(f"imported {args.hf_dir} → {out} (continued pretraining: python -m recipes.launch "
                  f"--nproc-per-node N --config {out / 'recipe.yaml'} data.blend=[PREFIX])")
        else:
            files.enable_named(args.checkpoint, args.msc_config)
            out = export_hf(args.checkpoint, args.output, args.max_shard_size, args.workers)
            print(f"exported {args.checkpoint} → {out}")
    except RecipeError as e:  # a conversion, checkpoint, config or tokenizer error: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":  # guard required: dist_checkpointing's save spawns a helper process
    sys.exit(main())
