"""Checkpoint integrity: a manifest of every file's size and CRC32, written after the data and verified before a load.

The checksums are spread over the ranks (each reads a share of the files), so writing and checking the
manifest costs one read of the checkpoint divided by the world size (CRC32 runs at ~3 GB/s per core).
A checkpoint without a manifest (saved before this existed) is loaded unverified.
"""

from __future__ import annotations

import json
import zlib
from typing import Optional

import torch.distributed as dist

from megatron_ext.checkpoint.layout import MANIFEST, has_manifest
from megatron_ext.storage.files import AnyPath, write_atomically

_CHUNK = 8 << 20


def _crc32(path: AnyPath) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _data_files(ckpt_dir: AnyPath) -> list[str]:
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _rank_and_world() -> tuple[int, int]:
    """This process's share of the work; a lone process (``python -m recipes.checkpoints``) checks every file."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _my_share(names: list[str]) -> list[str]:
    rank, world = _rank_and_world()
    return names[rank::world]


def _gather(value: object) -> list:
    if not dist.is_initialized():
        return [value]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _from_rank0(value: object) -> object:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_manifest(ckpt_dir: AnyPath) -> None:
    """Collective, after every rank's data is on disk: rank 0 writes ``manifest.json`` (temp file, then rename)."""
    names = _from_rank0(_data_files(ckpt_dir) if _rank_and_world()[0] == 0 else None)
    mine = {name: {"bytes": (ckpt_dir / name).stat().st_size, "crc32": _crc32(ckpt_dir / name)}
            for name in _my_share(names)}
    shares = _gather(mine)
    if _rank_and_world()[0] == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        write_atomically(ckpt_dir / MANIFEST, json.dumps({"files": dict(sorted(files.items()))}, indent=1))


def _problem(ckpt_dir: AnyPath, name: str, expected: dict, read: bool = True) -> Optional[str]:
    """What is wrong with one file: missing, another size, and (with `read`) another CRC32."""
    path = ckpt_dir / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path} has {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)"
    if read and _crc32(path) != expected["crc32"]:
        return f"{path} does not match its CRC32 in {ckpt_dir / MANIFEST} (corrupted)"
    return None


def sizes_match(ckpt_dir: AnyPath) -> bool:
    """One process, no reads: every file of the manifest is there with its size (a quick look, not :func:`verify`)."""
    try:
        files = json.loads((ckpt_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return not any(_problem(ckpt_dir, name, entry, read=False) for name, entry in files.items())


def verify(ckpt_dir: AnyPath) -> Optional[str]:
    """Collective: None when every file matches the manifest (or there is no manifest), else the first problem."""
    manifest = None
    if _rank_and_world()[0] == 0 and has_manifest(ckpt_dir):
        try:
            manifest = json.loads((ckpt_dir / MANIFEST).read_text())["files"]
        except (ValueError, KeyError) as e:
            manifest = {"": {"error": f"{ckpt_dir / MANIFEST} is unreadable: {e}"}}
    files = _from_rank0(manifest)
    if files is None:
        return None
    if "" in files:
        return files[""]["error"]
    mine = [p for name in _my_share(sorted(files)) if (p := _problem(ckpt_dir, name, files[name]))]
    found = [p for share in _gather(mine) for p in share]
    return found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else "") if found else None
