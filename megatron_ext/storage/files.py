"""A run's files and directories — checkpoints, their tracker and manifest, the run's records beside them — on a
local file system or in object storage (``msc://PROFILE/...``, S3 and compatible stores through NVIDIA's
multi-storage-client, which megatron-core's dist_checkpointing writes and reads itself once its MSC feature is on).

:func:`at` gives a local path a :class:`pathlib.Path` and an object-storage one multi-storage-client's pathlib-like
``MultiStoragePath``, so reading, listing and writing whole files is the same code for both. What differs is said
here, once: a local replacement is made atomic by a rename where an object appears whole when its upload completes; a
local lock is created with ``O_EXCL`` where an object is created with S3's ``If-None-Match: *``; a directory tree is
removed by ``rmtree`` locally and by deleting every object under its prefix in object storage; a local file is
refreshed by touching it, an object by writing it again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

from megatron_ext.config.paths import is_object_storage
from megatron_ext.config.schema import RecipeConfig
from megatron_ext.errors import ConfigError, require

MSC_CONFIG_ENV = "MSC_CONFIG"  # where multi-storage-client reads its configuration file

AnyPath = Union[Path, Any]  # a pathlib.Path, or multi-storage-client's MultiStoragePath


def enable(msc_config: str | Path) -> Any:
    """Point multi-storage-client at `msc_config` (for this process and the processes it starts) and turn on
    megatron-core's MSC paths; multi-storage-client's module."""
    from megatron.core.msc_utils import MultiStorageClientFeature

    os.environ[MSC_CONFIG_ENV] = str(Path(msc_config).absolute())
    MultiStorageClientFeature.enable()
    return MultiStorageClientFeature.import_package()


def enable_for(cfg: RecipeConfig, key: str, location: str) -> Any:
    """:func:`enable` with the run's storage.msc_config, which `key` (naming `location` in object storage) needs;
    ConfigError when it is missing."""
    require(cfg.storage.msc_config is not None, "storage.msc_config", None,
            f"{key} names {location} in object storage: name multi-storage-client's configuration file (its profiles)")
    require(Path(cfg.storage.msc_config).is_file(), "storage.msc_config", cfg.storage.msc_config, "does not exist")
    return enable(cfg.storage.msc_config)


def enable_named(location: str, msc_config: Optional[str], option: str = "--msc-config") -> None:
    """For a command given `location`: when it is in object storage, :func:`enable` with `msc_config` (the command's
    `option`), which must then be named and exist (ConfigError otherwise)."""
    if not is_remote(location):
        return
    if msc_config is None:
        raise ConfigError(f"{location} is in object storage: name multi-storage-client's configuration with {option} "
                          "(the run's storage.msc_config)")
    require(Path(msc_config).is_file(), option, msc_config, "does not exist")
    enable(msc_config)
    try:
        at(location)
    except ValueError as e:  # a profile the configuration does not have
        raise ConfigError(f"{location}: multi-storage-client cannot resolve it with {option}={msc_config}: "
                          f"{str(e).splitlines()[0]}") from None


def _msc() -> Any:
    """multi-storage-client, with megatron-core's MSC paths on (its configuration named by the environment, as
    :func:`enable` left it for every process of the run)."""
    from megatron.core.msc_utils import MultiStorageClientFeature

    MultiStorageClientFeature.enable()
    return MultiStorageClientFeature.import_package()


def is_remote(path: str | AnyPath) -> bool:
    return is_object_storage(str(path))


def at(location: str | AnyPath) -> AnyPath:
    """`location` as a path object: multi-storage-client's for object storage (an s3:// URL as the msc:// one its
    configuration maps it to), else pathlib's."""
    return _msc().Path(str(location)) if is_remote(location) else Path(location)


def msc_url(location: str) -> str:
    """An object-storage `location` as multi-storage-client names it (msc://PROFILE/..., an s3:// URL through the
    configuration's path_mapping); another location unchanged. megatron-core reads msc:// data through the client,
    while it would read s3:// data with boto3 alone (its own credentials and endpoint, not the run's)."""
    return str(at(location)) if is_remote(location) else location


def checkpoint_reader(directory: str | AnyPath) -> Any:
    """torch's reader of the distributed checkpoint at `directory`: multi-storage-client's for object storage (as
    megatron-core's own load picks it), else torch's FileSystemReader."""
    if is_remote(directory):
        return _msc().torch.MultiStorageFileSystemReader(str(directory), thread_count=2)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(directory))


def remove_tree(path: str | AnyPath) -> None:
    """Delete the directory `path` and everything under it (nothing when it does not exist)."""
    if is_remote(path):
        client, key = _msc().resolve_storage_client(str(path))
        _delete_objects(client, key.rstrip("/") + "/")
    else:
        shutil.rmtree(path, ignore_errors=True)


def _delete_objects(client: Any, prefix: str) -> None:
    """Every object under `prefix`, deleted in batches (the client's recursive delete draws a progress bar)."""
    keys = [found.key for found in client.list(prefix=prefix)]
    if keys:
        client.delete_many(keys)


def write_atomically(path: AnyPath, text: str) -> None:
    """Replace `path`'s content with `text` so that a reader sees the old content or the new, whole: locally a
    temporary file renamed over it, in object storage one upload."""
    if is_remote(path):
        path.write_text(text)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _provider(path: AnyPath) -> tuple[Any, str]:
    """The object's storage provider and key: its conditional uploads (S3's If-None-Match / If-Match), which
    multi-storage-client's client does not offer."""
    client, key = _msc().resolve_storage_client(str(path))
    return client._storage_provider, key


def create_exclusively(path: AnyPath, text: str) -> bool:
    """Create `path` holding `text` unless it exists (atomically: of two creators one wins); whether this one did."""
    if is_remote(path):
        from multistorageclient.types import PreconditionFailedError

        provider, key = _provider(path)
        try:
            provider.put_object(key, text.encode(), if_none_match="*")
        except PreconditionFailedError:
            return False
        return True
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def refresh(path: AnyPath) -> None:
    """Make `path`'s modification time now (a lock's heartbeat); an object is written again with its own content,
    only if no one replaced it meanwhile (If-Match on the version just read)."""
    if not is_remote(path):
        os.utime(path)
        return
    from multistorageclient.types import PreconditionFailedError

    provider, key = _provider(path)
    etag = _msc().info(str(path)).etag
    with contextlib.suppress(PreconditionFailedError):  # replaced: the holder sees it lost its lock
        provider.put_object(key, path.read_bytes(), if_match=etag)


def rename_tree(path: AnyPath, target: AnyPath) -> None:
    """Move the directory `path` to `target` (in object storage: every object copied, then the originals deleted)."""
    if not is_remote(path):
        Path(path).rename(target)
        return
    client, key = _msc().resolve_storage_client(str(path))
    _, new = _msc().resolve_storage_client(str(target))
    prefix, new_prefix = key.rstrip("/") + "/", new.rstrip("/") + "/"
    for found in client.list(prefix=prefix):
        client.copy(found.key, new_prefix + found.key[len(prefix):])
    _delete_objects(client, prefix)
