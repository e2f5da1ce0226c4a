"""Token data in object storage: msc://PROFILE/prefix (or s3://BUCKET/prefix, which the client maps to a profile)
blends read through NVIDIA's multi-storage-client (MSC).

megatron-core reads such a dataset itself (``datasets/object_storage_utils.py``, ``indexed_dataset.py``): rank 0
downloads the index (.idx) into a local cache, every rank reads the tokens (.bin) in byte ranges, without memory
mapping. What this module adds: the run's own MSC configuration (``storage.msc_config``, set for every process before
the client first reads its configuration), and the checks made before any rank starts, each refused in one line
naming the key — the configuration and its profile, both objects present, the index one megatron-core can read and
describing no more tokens than the .bin holds, and every token id below the vocabulary (one ranged pass over the
.bin, remembered in the cache under the objects' sizes and entity tags, as local data is under its content stamp).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from megatron.core.datasets.object_storage_utils import get_index_cache_path

from megatron_ext.config.paths import blend_prefixes, is_object_storage
from megatron_ext.config.schema import RecipeConfig, object_storage_cache
from megatron_ext.errors import ConfigError
from megatron_ext.storage import files


def uses_object_storage(cfg: RecipeConfig) -> bool:
    """Whether any of the recipe's blends reads from object storage."""
    return not cfg.data.mock and any(is_object_storage(prefix) for _, prefix in blend_prefixes(cfg))


def enable(cfg: RecipeConfig) -> Any:
    """Point multi-storage-client at storage.msc_config and turn on megatron-core's MSC paths, in this process (a
    no-op without object-storage data); multi-storage-client's module, or None."""
    return files.enable(cfg.storage.msc_config) if uses_object_storage(cfg) else None


def as_read(blend: Optional[tuple[list[str], Optional[list[float]]]]
            ) -> Optional[tuple[list[str], Optional[list[float]]]]:
    """A parsed blend with its object-storage prefixes as megatron-core reads them (:func:`files.msc_url`)."""
    return None if blend is None else ([files.msc_url(prefix) for prefix in blend[0]], blend[1])


def index_cache_path(cfg: RecipeConfig, prefix: str) -> Path:
    """Where megatron-core keeps the downloaded index of the object-storage dataset `prefix`."""
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

    return Path(get_index_cache_path(files.msc_url(prefix) + ".idx",
                                     ObjectStorageConfig(path_to_idx_cache=object_storage_cache(cfg))))


def validate_objects(cfg: RecipeConfig, key: str, prefix: str, check_index: Callable[[str, str, int], None]) -> None:
    """The object-storage dataset `prefix` (named by `key`): its configuration, both objects, and its index checked
    by `check_index(key, index_path, bin_bytes)`."""
    msc = files.enable_for(cfg, key, prefix)
    sizes = {}
    for suffix in (".bin", ".idx"):
        try:
            sizes[suffix] = msc.info(prefix + suffix).content_length
        except FileNotFoundError:
            raise ConfigError(f"{key}={prefix} is invalid: {prefix}{suffix} does not exist in object storage (a prefix "
                              "names PREFIX.bin + PREFIX.idx)") from None
        except (ValueError, OSError, RuntimeError) as e:  # an unknown profile, an unreachable endpoint, a refusal
            raise ConfigError(f"{key}={prefix} is invalid: multi-storage-client cannot read {prefix}{suffix} with "
                              f"storage.msc_config={cfg.storage.msc_config}: {str(e).splitlines()[0]}") from None
    index = index_cache_path(cfg, prefix)
    index.parent.mkdir(parents=True, exist_ok=True)
    msc.download_file(prefix + ".idx", str(index))
    check_index(key, str(index), sizes[".bin"])


def objects_stamp(cfg: RecipeConfig, prefix: str) -> dict[str, list[Any]]:
    """What the remembered largest token id of `prefix` is tied to: both objects' sizes and entity tags."""
    msc = enable(cfg)
    return {suffix: [(info := msc.info(prefix + suffix)).content_length, info.etag] for suffix in (".bin", ".idx")}


def dataset(cfg: RecipeConfig, prefix: str) -> Any:
    """megatron-core's indexed dataset of the object-storage `prefix` (its index from the cache, the tokens in
    ranges)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

    enable(cfg)
    return IndexedDataset(files.msc_url(prefix), mmap=False,
                          object_storage_config=ObjectStorageConfig(path_to_idx_cache=object_storage_cache(cfg)))
