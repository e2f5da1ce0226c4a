"""Every file-system path a config names, by key (object-storage paths apart), and the check that each lies inside a
container's mounts.

Under pyxis (``launch/slurm/common.sh`` with ``CONTAINER_IMAGE``) a path outside the step's mounts is the
container's own file system: data there is missing, and a checkpoint written there vanishes with the container.
The SLURM step and ``launch/docker_run.sh`` export their mounts (``CONTAINER_MOUNTS_ENV``); a config naming a path
outside them is refused in one line before any rank starts, naming the key, the path and the mount to add.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_ext.config.schema import RecipeConfig, log_dir, object_storage_cache, parse_blend, resume_dir
from megatron_ext.errors import ConfigError

CONTAINER_MOUNTS_ENV = "CONTAINER_MOUNTED"  # the step's --container-mounts (src:dst[:flags], comma separated)
# a path in object storage, read through NVIDIA's multi-storage-client (storage.msc_config): megatron-core's MSC_PREFIX
# (datasets/object_storage_utils.py; a unit test holds the two equal — this package stays importable without it)
MSC_PREFIX = "msc://"
# an S3 URL, which multi-storage-client maps to one of its profiles (its configuration's path_mapping; without one,
# a profile of the bucket with the environment's AWS credentials)
S3_PREFIX = "s3://"


def is_object_storage(path: str) -> bool:
    """Whether `path` is an object in object storage (msc://PROFILE/... or s3://BUCKET/...) rather than a file-system
    path."""
    return str(path).startswith((MSC_PREFIX, S3_PREFIX))


def blend_prefixes(cfg: RecipeConfig) -> list[tuple[str, str]]:
    """(data.KEY, dataset prefix) for every prefix the blends name."""
    pairs = []
    for key in ("blend", "train_blend", "valid_blend", "test_blend"):
        parsed = parse_blend(getattr(cfg.data, key), f"data.{key}")
        pairs += [(f"data.{key}", prefix) for prefix in (parsed[0] if parsed else [])]
    return pairs


def named_paths(cfg: RecipeConfig) -> list[tuple[str, str, bool]]:
    """(key, path, written) for every file-system path `cfg` reads or writes (`written`: the run writes there); its
    object-storage locations are multi-storage-client's to reach."""
    d, ck, g = cfg.data, cfg.checkpoint, cfg.logging
    data = [] if d.mock else [*blend_prefixes(cfg), ("data.tokenizer_model", d.tokenizer_model)]
    read = [*data, ("checkpoint.load", resume_dir(cfg)), ("checkpoint.pretrained_checkpoint", ck.pretrained_checkpoint),
            ("storage.msc_config", cfg.storage.msc_config)]
    remote = not d.mock and any(is_object_storage(p) for _, p in blend_prefixes(cfg))
    written = [(k, p) for k, p in (("checkpoint.save", ck.save), ("logging.tensorboard_dir", g.tensorboard_dir),
                                   ("logging.log_dir", log_dir(cfg)), ("data.path_to_cache", d.path_to_cache),
                                   ("storage.cache", object_storage_cache(cfg) if remote else None)) if p]
    seen = {p for _, p in written}  # checkpoint.load: auto reads what checkpoint.save writes
    local = [(k, p, True) for k, p in written] + [(k, p, False) for k, p in read if p and p not in seen]
    return [(k, p, w) for k, p, w in local if not is_object_storage(p)]


def _inside(path: Path, mounted: list[Path]) -> bool:
    return any(path == m or m in path.parents for m in mounted)


def refuse_unmounted_paths(cfg: RecipeConfig) -> None:
    """Under a container step that exported its mounts: ConfigError for the first path `cfg` names outside them."""
    mounts = os.environ.get(CONTAINER_MOUNTS_ENV)
    if not mounts:
        return
    mounted = [Path(m.split(":")[1] if ":" in m else m) for m in mounts.split(",") if m]
    for key, path, written in named_paths(cfg):
        where = Path(os.path.abspath(path))
        if not _inside(where, mounted):
            lost = ("the run would write it inside the container, where it is lost with the container" if written
                    else "the ranks cannot see it inside the container")
            raise ConfigError(f"{key}={path} lies outside the container's mounts ({', '.join(map(str, mounted))}): "
                              f"{lost}; mount {where.parent} (CONTAINER_MOUNTS={where.parent}:{where.parent} under SLURM, "
                              f"DOCKER_ARGS='-v {where.parent}:{where.parent}' with docker_run.sh) or move it under a "
                              "mount")
