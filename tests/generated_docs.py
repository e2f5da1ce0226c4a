"""Numbers in the docs that come from the code: a block between

    <!-- generated: python -m recipes.MODULE ARG ... -->
    ...
    <!-- end generated -->

in README.md or docs/*.md is what that command prints. ``tests/unit/test_generated_docs.py`` holds every block to
its command; ``.venv/bin/python -m tests.generated_docs`` rewrites the stale ones (after a planner or schema change).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- generated: python -m (recipes\.\w+)((?: [^\n]*?)?) -->\n(.*?)<!-- end generated -->",
                   re.DOTALL)


@dataclass(frozen=True)
class Block:
    path: Path
    module: str
    args: tuple[str, ...]
    text: str  # as the file has it

    @property
    def command(self) -> str:
        return f"python -m {self.module} {' '.join(self.args)}".rstrip()


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    return [Block(path, m[1], tuple(shlex.split(m[2])), m[3]) for m in BLOCK.finditer(path.read_text())]


def output(block: Block) -> str:
    """What the block's command prints, run in this process from the repository root (relative paths)."""
    printed = io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(printed):
        code = importlib.import_module(block.module).main(list(block.args))
    assert code in (0, None), f"{block.command} exited {code}"
    text = printed.getvalue()
    return text if text.endswith("\n") else text + "\n"


def main() -> int:
    stale = []

    def regenerate(match: re.Match) -> str:
        block = Block(path, match[1], tuple(shlex.split(match[2])), match[3])
        fresh = output(block)
        if fresh != block.text:
            stale.append(f"{path.relative_to(ROOT)}: `{block.command}`")
        return match[0].replace(f"-->\n{block.text}<!-- end generated -->", f"-->\n{fresh}<!-- end generated -->")

    for path in documents():
        path.write_text(BLOCK.sub(regenerate, path.read_text()))
    print("\n".join(["regenerated:", *stale] if stale else ["every generated block is current"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
