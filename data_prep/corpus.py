"""Builds the offline default corpus: the Python standard library's own source as jsonl."""

import argparse
import json
import logging
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})
DEFAULT_MAX_BYTES = 6_000_000


@dataclass
class CorpusResult:
    path: str
    files: int
    text_bytes: int
    undecodable: int
    seconds: float


def stdlib_sources(root: str) -> list[str]:
    """Relative posix paths of all .py files under `root` outside SKIP_DIRS, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        found.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def build_corpus(output: str, max_bytes: int = DEFAULT_MAX_BYTES) -> CorpusResult:
    """Write one {"text": source} line per stdlib file, stopping once max_bytes of text are written."""
    start = time.perf_counter()
    root = sysconfig.get_paths()["stdlib"]
    files = text_bytes = undecodable = 0
    tmp = f"{output}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for rel in stdlib_sources(root):
                raw = Path(root, rel).read_bytes()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    undecodable += 1
                    continue
                if not text.strip():  # empty __init__.py files would only add empty documents
                    continue
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                files += 1
                text_bytes += len(raw)
                if text_bytes >= max_bytes:
                    break
        if files == 0:
            raise ValueError(f"no usable .py files under {root}")
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return CorpusResult(output, files, text_bytes, undecodable, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help="stop once this many bytes of UTF-8 text are written (whole files, "
                             "so the last one may overshoot)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = build_corpus(args.output, args.max_bytes)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    logger.info(
        "wrote %s: %d documents, %d bytes of text from %s (%d undecodable files skipped) in %.1fs",
        result.path, result.files, result.text_bytes, sysconfig.get_paths()["stdlib"],
        result.undecodable, result.seconds,
    )


if __name__ == "__main__":
    main()
