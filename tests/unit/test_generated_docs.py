"""Every generated block in README.md and docs/*.md is what its command prints (tests/generated_docs.py)."""

from __future__ import annotations

import pytest

from tests.generated_docs import blocks, documents, output

BLOCKS = [b for path in documents() for b in blocks(path)]


def test_the_docs_have_generated_blocks():
    assert {b.module for b in BLOCKS} >= {"recipes.plan", "recipes.pretrain"}


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.path.name}:{b.command}")
def test_a_generated_block_is_what_its_command_prints(block):
    assert block.text == output(block), "stale: .venv/bin/python -m tests.generated_docs rewrites it"
