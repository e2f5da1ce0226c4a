"""Checkpoint integrity: a manifest of every file's size and CRC32, written after the data and verified before a load.

The checksums are spread over the ranks (each reads a share of the files), so writing and checking the
manifest costs one read of the checkpoint divided by the world size (CRC32 runs at ~3 GB/s per core).
A checkpoint without a manifest (saved before this existed) is loaded unverified.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Optional

import torch.distributed as dist

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _data_files(ckpt_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _my_share(names: list[str]) -> list[str]:
    return names[dist.get_rank()::dist.get_world_size()]


def write_manifest(ckpt_dir: Path) -> None:
    """Collective, after every rank's data is on disk: rank 0 writes ``manifest.json`` (temp file, then rename)."""
    names = [_data_files(ckpt_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    mine = {name: {"bytes": (ckpt_dir / name).stat().st_size, "crc32": _crc32(ckpt_dir / name)}
            for name in _my_share(names[0])}
    shares: list[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    if dist.get_rank() == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        tmp = ckpt_dir / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1))
        os.replace(tmp, ckpt_dir / MANIFEST)


def has_manifest(ckpt_dir: Path) -> bool:
    return (ckpt_dir / MANIFEST).is_file()


def _problem(ckpt_dir: Path, name: str, expected: dict) -> Optional[str]:
    path = ckpt_dir / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path} has {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)"
    if _crc32(path) != expected["crc32"]:
        return f"{path} does not match its CRC32 in {ckpt_dir / MANIFEST} (corrupted)"
    return None


def verify(ckpt_dir: Path) -> Optional[str]:
    """Collective: None when every file matches the manifest (or there is no manifest), else the first problem."""
    manifest = [None]
    if dist.get_rank() == 0 and has_manifest(ckpt_dir):
        try:
            manifest[0] = json.loads((ckpt_dir / MANIFEST).read_text())["files"]
        except (ValueError, KeyError) as e:
            manifest[0] = {"": {"error": f"{ckpt_dir / MANIFEST} is unreadable: {e}"}}
    dist.broadcast_object_list(manifest, src=0)
    if manifest[0] is None:
        return None
    files = manifest[0]
    if "" in files:
        return files[""]["error"]
    mine = [p for name in _my_share(sorted(files)) if (p := _problem(ckpt_dir, name, files[name]))]
    problems: list[Optional[list[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, mine)
    found = [p for share in problems for p in share]
    return found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else "") if found else None
