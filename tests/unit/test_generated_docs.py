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


def test_estimates_quoted_in_prose_are_the_planners():
    """Planner numbers the docs quote in sentences rather than generated blocks: the 8B recipe's step, memory and
    time to train in quickstart-gpu.md, and the 405B recipe's explanation excerpted in memory.md."""
    from megatron_ext.config.schema import load_config
    from megatron_ext.hardware import GPUS
    from megatron_ext.metrics.units import format_duration
    from megatron_ext.planner import GIB, estimate, explain, model_vocab_size
    from tests.launch import ROOT

    h100 = GPUS["h100-80gb"]
    cfg = load_config(ROOT / "configs" / "llama3_8b_8gpu_bf16.yaml")
    e = estimate(cfg, 8, 8, h100, model_vocab_size(cfg))
    seconds = e.time["step"] * cfg.train.train_iters
    quoted = (f"{e.time['step']:.1f} s/step, {e.memory['total'] / GIB:.0f} GiB; {cfg.train.train_iters:,} iterations "
              f"≈ {format_duration(seconds)}, {seconds * 8 / 3600:,.0f} GPU-hours")
    assert quoted in " ".join((ROOT / "docs" / "quickstart-gpu.md").read_text().split()), quoted

    cfg = load_config(ROOT / "configs" / "llama3_1_405b_40gpu_bf16.yaml")
    explanation = explain(estimate(cfg, 40, 8, h100, model_vocab_size(cfg)), h100)
    memory_doc = (ROOT / "docs" / "memory.md").read_text()
    excerpt = memory_doc.split("`configs/llama3_1_405b_40gpu_bf16.yaml`):\n\n```\n")[1].split(" Without offload")[0]
    for fragment in " ".join(excerpt.split()).split(" ... "):
        assert fragment.strip(" .") in explanation, fragment
