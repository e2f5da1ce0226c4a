"""List a checkpoint directory: ``python -m recipes.checkpoints DIR [--verify] [--config YAML [overrides ...]]``
(DIR in object storage, ``msc://PROFILE/prefix``, with ``--msc-config FILE``: the run's storage.msc_config).

One line per ``iter_XXXXXXX``: complete (manifest present; with ``--verify``, every file's size and CRC32
checked), partial or set aside as corrupt, its size, the layout, precision and distributed-optimizer format
(:mod:`megatron_ext.checkpoint.optimizer_format`) it was saved with, and which one
the tracker names. With ``--config`` (and ``section.key=value`` overrides), the differences between the config
saved in the newest checkpoint and that config, as a resume would list them, and whether the resume would be
refused for changed parameter shapes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from megatron_ext.checkpoint import manifest
from megatron_ext.checkpoint.common_state import CommonState, read_common
from megatron_ext.checkpoint.layout import (
    COMMON_STATE,
    DCP_METADATA,
    DIST_METADATA,
    TRACKER,
    has_manifest,
    iteration_dirs,
    latest_iteration,
)
from megatron_ext.config.schema import load_config
from megatron_ext.errors import CheckpointError, ConfigError
from megatron_ext.storage import files


def _layout(common: CommonState) -> str:
    config = common.config
    p, t = config.get("parallel", {}), config.get("train", {})
    if not p:
        return "layout unknown"
    return (f"TP{p['tensor_model_parallel_size']}×PP{p['pipeline_model_parallel_size']}"
            + (f"×VPP{p['virtual_pipeline_model_parallel_size']}" if p.get("virtual_pipeline_model_parallel_size") else "")
            + f"×CP{p['context_parallel_size']}, {t.get('precision', '?')}" + (f"+FP8 {t['fp8']}" if t.get("fp8") else "")
            + (f", Megatron-FSDP {p['data_parallel_sharding_strategy']}" if p.get("use_megatron_fsdp") else "")
            + (f" in {p['num_distributed_optimizer_instances']} HSDP groups ({p.get('outer_dp_sharding_strategy')} "
               "across them)" if p.get("num_distributed_optimizer_instances", 1) > 1 else "")
            + (f", optimizer {common.optimizer_format}" if p.get("use_distributed_optimizer")
               and common.optimizer_format else ""))


def _size(path: Path) -> str:
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return f"{total / 2**30:.2f} GiB" if total >= 2**30 else f"{total / 2**20:.1f} MiB"


def describe(root: Path, verify: bool) -> tuple[list[str], Optional[Path]]:
    """Lines describing `root`'s checkpoints, and the newest complete one."""
    tracked = latest_iteration(root)
    lines, newest = [], None
    for iteration, path, set_aside in iteration_dirs(root):
        if set_aside:
            state = "corrupt (set aside)"
        elif not has_manifest(path):
            written = (path / DIST_METADATA).is_file() or (path / DCP_METADATA).is_file()
            state = "no manifest (partial, or saved before manifests)" if written else "partial"
        else:
            problem = manifest.verify(path) if verify else None
            state = f"CORRUPT: {problem}" if problem else ("complete, verified" if verify else "complete")
            if not problem:
                newest = path
        tracker = "  <- tracker" if not set_aside and iteration == tracked else ""
        layout = "-" if set_aside else _readable_layout(path)
        lines.append(f"{path.name:24} {state:40} {_size(path):>10}  {layout}{tracker}")
    return lines, newest


def _readable_layout(path: Path) -> str:
    """The layout a checkpoint was saved in, "-" where it has no common state yet, or why it cannot be read."""
    if not ((path / COMMON_STATE).is_file() or (path / DIST_METADATA).is_file()):
        return "-"
    try:
        return _layout(read_common(path))
    except CheckpointError:
        return "common state unreadable"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.checkpoints", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="a checkpoint.save directory (local, or msc://PROFILE/prefix)")
    parser.add_argument("--msc-config", help="multi-storage-client's configuration (the run's storage.msc_config), for "
                                             "a directory in object storage")
    parser.add_argument("--verify", action="store_true", help="check every file against its manifest (reads it all)")
    parser.add_argument("--config", help="compare the newest checkpoint's config with this recipe YAML")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides of --config")
    args = parser.parse_intermixed_args(argv)
    try:
        files.enable_named(args.directory, args.msc_config)
        directory = files.at(args.directory)
        if not directory.is_dir():
            raise CheckpointError(f"{args.directory} is not a directory")
        lines, newest = describe(directory, args.verify)
        print(f"{args.directory} (tracker {directory / TRACKER}: {latest_iteration(directory)})")
        print("\n".join(lines) if lines else "  no iter_XXXXXXX directories")
        if args.config and newest is not None:
            from megatron_ext.checkpoint.resume import config_differences, shape_changes

            saved, current = read_common(newest).config, load_config(args.config, args.overrides).to_dict()
            differences = config_differences(saved, current)
            print(f"\nconfig of {newest.name} → {args.config}" + (" " + " ".join(args.overrides) if args.overrides else "")
                  + ":\n" + ("\n".join(f"  {key}: {old!r} → {new!r}" for key, old, new in differences) or "  no differences"))
            changed = shape_changes(saved, current)
            if changed:
                print(f"a resume would be refused: parameter shapes differ ({'; '.join(changed)})")
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
