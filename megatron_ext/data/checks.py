"""The data a recipe names, checked before any process starts: each blend prefix's files exist (in object storage:
data/object_storage.py), the split is valid, the tokenizer loads, and every token id in the data fits the model's
vocabulary (one read of each .bin, then remembered per file so a restart pays nothing)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.config.paths import blend_prefixes, is_object_storage
from megatron_ext.config.schema import RecipeConfig
from megatron_ext.data import object_storage
from megatron_ext.data.datasets import max_token_id
from megatron_ext.data.tokenizer import load_tokenizer
from megatron_ext.errors import ConfigError, TokenizerError, require


def validate_data(cfg: RecipeConfig) -> None:
    """The data files, split and tokenizer of `cfg` (nothing to check for mock data beyond its vocabulary)."""
    d = cfg.data
    if d.mock:
        require(cfg.model.vocab_size is not None, "model.vocab_size", None,
                "data.mock=true needs an explicit vocabulary size")
        return
    has_split_blends = any(b for b in (d.train_blend, d.valid_blend, d.test_blend))
    require(bool(d.blend) or has_split_blends, "data.blend", d.blend,
            "give a dataset prefix list (or data.train_blend/valid_blend)")
    for key, prefix in blend_prefixes(cfg):
        if is_object_storage(prefix):
            object_storage.validate_objects(cfg, key, prefix, partial(_check_index_matches_bin, prefix=prefix))
            continue
        for suffix in (".bin", ".idx"):
            require(Path(prefix + suffix).is_file(), key, prefix,
                    f"{prefix}{suffix} does not exist (a prefix names PREFIX.bin + PREFIX.idx)")
        _check_index_matches_bin(key, prefix + ".idx", os.path.getsize(prefix + ".bin"), prefix)
    try:
        parts = [float(x) for x in d.split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    require(len(parts) == 3 and all(x >= 0 for x in parts) and sum(parts) > 0, "data.split", d.split,
            "three non-negative numbers like 98,2,0 (train,valid,test)")
    require(d.tokenizer_model is not None, "data.tokenizer_model", d.tokenizer_model,
            "a sentencepiece .model file or a Hugging Face tokenizer directory")
    try:
        vocab = load_tokenizer(d.tokenizer_model, d.tokenizer_type).vocab_size
    except TokenizerError as e:
        raise ConfigError(f"data.tokenizer_model={d.tokenizer_model!r} is invalid: {e}") from None
    require(cfg.model.vocab_size is None or cfg.model.vocab_size >= vocab, "model.vocab_size",
            cfg.model.vocab_size, f"must be >= the vocabulary of {d.tokenizer_model} ({vocab}) or null")
    _check_token_ids(cfg, cfg.model.vocab_size or vocab)


def _check_index_matches_bin(key: str, index_path: str, bin_bytes: int, prefix: str) -> None:
    """The .idx (at `index_path`: the dataset's, or the local copy of an object-storage one) is one megatron-core can
    read and the .bin (`bin_bytes` long) holds every token it describes: a truncated copy or a pair from two different
    runs is one error here, not a traceback from the first read past the end."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    redo = "re-run data_prep.preprocess for it, or copy both files again"
    try:
        index = _IndexReader(index_path, multimodal=False)
    except (AssertionError, ValueError, struct.error) as e:  # megatron-core's own checks are asserts
        raise ConfigError(f"{key}: {prefix}.idx is not a megatron-core index (version 1) it can read: "
                          f"{str(e) or type(e).__name__}; {redo}") from None
    problem = index_layout_problem(index.sequence_lengths, index.sequence_pointers, index.document_indices,
                                   index.dtype_size)
    require(problem is None, key, prefix, f"{prefix}.idx is inconsistent: {problem}; {redo}")
    count = len(index.sequence_lengths)
    described = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size if count else 0
    actual = bin_bytes
    require(actual >= described, key, prefix,
            f"{prefix}.bin is {actual:,} bytes, but {prefix}.idx describes {described:,} bytes of tokens "
            f"({count:,} sequences of {index.dtype.__name__}): the .bin is cut short or belongs to another index; "
            f"{redo}")


def index_layout_problem(lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray,
                         token_bytes: int) -> Optional[str]:
    """What is wrong with an index's arrays as megatron-core writes them, or None: no negative length, each sequence
    starting where the previous one ends (megatron-core's C++ index builder trusts both, so a forged value reads out
    of bounds), document boundaries rising from 0 to the sequence count. Vectorised: one pass over each array."""
    if len(lengths) and lengths.min() < 0:
        first = int(np.argmax(lengths < 0))
        return f"sequence {first} has length {int(lengths[first])}"
    expected = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
    expected *= token_bytes
    if not np.array_equal(pointers, expected):
        first = int(np.argmax(pointers != expected))
        return f"sequence {first} starts at byte {int(pointers[first])}, not {int(expected[first])} (where the one " \
               "before it ends)"
    if len(documents) == 0 or documents[0] != 0 or documents[-1] != len(lengths) or (np.diff(documents) < 0).any():
        return (f"its document boundaries are not a rising list from 0 to the sequence count {len(lengths)} "
                f"(first {documents[:1].tolist()}, last {documents[-1:].tolist()})")
    return None


def _check_token_ids(cfg: RecipeConfig, vocab: int) -> None:
    """Every token id in the data below the model's vocabulary: data written with another tokenizer is one error
    here, not a device-side assert in the embedding or a silently wrong run. One pass over every .bin, by the
    first process of each node only (the others would read the same pages again)."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    d = cfg.data
    for key, prefix in blend_prefixes(cfg):
        if is_object_storage(prefix):  # remembered beside the downloaded index, under both objects' sizes and etags
            top = _remembered_max_token_id(object_storage.index_cache_path(cfg, prefix).with_suffix(".max_token_id.json"),
                                           object_storage.objects_stamp(cfg, prefix),
                                           partial(object_storage.dataset, cfg, prefix), prefix)
        else:
            top = cached_max_token_id(prefix, d.path_to_cache)
        require(top < vocab, key, prefix,
                f"{prefix}.bin holds token id {top}, but the model's vocabulary is {vocab} "
                f"(data.tokenizer_model={d.tokenizer_model}): the data was written with another tokenizer — "
                "preprocess it with this one, or point data.tokenizer_model at the one that wrote it")


def _cache_file(prefix: str, cache_root: Optional[str]) -> Path:
    """Where the largest token id of `prefix` is remembered: data.path_to_cache, else the ``cache/`` directory
    next to the data, as megatron-core's own dataset index cache."""
    name = Path(prefix).name
    if cache_root is None:
        return Path(prefix).parent / "cache" / "max_token_id" / f"{name}.json"
    digest = hashlib.sha1(str(Path(prefix).resolve()).encode()).hexdigest()[:12]
    return Path(cache_root) / "max_token_id" / f"{name}-{digest}.json"


_SAMPLED_BLOCKS, _BLOCK_BYTES = 16, 64 << 10


def content_stamp(prefix: str) -> dict[str, Any]:
    """What the remembered largest token id is tied to: both files' sizes and modification times, the .idx's whole
    content and 16 blocks of 64 KiB spread over the .bin (hashed: a few ms for a 1 GB dataset), so a file rewritten
    under the same size and time (``cp -p``, ``rsync -t``) is scanned again."""
    stamp: dict[str, Any] = {suffix: [(st := os.stat(prefix + suffix)).st_size, st.st_mtime_ns]
                             for suffix in (".bin", ".idx")}
    digest = hashlib.sha256(Path(prefix + ".idx").read_bytes())
    size = stamp[".bin"][0]
    with open(prefix + ".bin", "rb") as f:
        for block in range(_SAMPLED_BLOCKS):
            f.seek(size * block // _SAMPLED_BLOCKS)
            digest.update(f.read(_BLOCK_BYTES))
    stamp["sha256"] = digest.hexdigest()
    return stamp


def cached_max_token_id(prefix: str, cache_root: Optional[str] = None) -> int:
    """The largest token id of the dataset at `prefix`: read from the cache while the files match the
    :func:`content_stamp` they had when it was computed, else computed (one pass over the .bin) and remembered."""
    return _remembered_max_token_id(_cache_file(prefix, cache_root), content_stamp(prefix),
                                    lambda: IndexedDataset(prefix), str(Path(prefix).resolve()))


def _remembered_max_token_id(cache: Path, stamp: Any, dataset: Callable[[], IndexedDataset], name: str) -> int:
    """The largest token id remembered in `cache` under `stamp` (what the data's files or objects were when it was
    computed), else one pass over `dataset()`, remembered. A cache that cannot be written (a read-only data directory)
    only costs the pass again next time."""
    try:
        saved = json.loads(cache.read_text())
        if saved["files"] == stamp:
            return int(saved["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    top = max_token_id(dataset())
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"prefix": name, "files": stamp, "max_token_id": top}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return top
