"""MoE options the recipe accepts, run through the real loop on one process (tiny MoE, 3 steps): DeepSeek-V3-style
routing — sigmoid scores, the auxiliary-loss-free expert bias and the sequence-wise auxiliary loss — with token
dropping at a capacity factor. A worker records each router's routing map and expert bias per step
(tests/workers/moe_options_worker.py); the test holds them to megatron-core's rules computed here: the bias moves by
the update rate against each expert's load, no expert keeps more tokens of a micro batch than its capacity, and the
logged dropped share is the one the routing maps show."""

from __future__ import annotations

import json
import math

import pytest

from tests.launch import ROOT, SINGLE_PROCESS, SMALL_MODEL, read_scalars, run_pretrain

TOPK, EXPERTS, RATE, CAPACITY_FACTOR = 2, 8, 1e-3, 1.0
OPTIONS = ["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
           f"model.moe_router_bias_update_rate={RATE}", "model.moe_router_load_balancing_type=seq_aux_loss",
           f"model.moe_expert_capacity_factor={CAPACITY_FACTOR}", "model.moe_token_drop_policy=probs"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_options")
    proc = run_pretrain(1, [*SMALL_MODEL, *SINGLE_PROCESS, "parallel.expert_model_parallel_size=1",
                            "train.train_iters=3", "checkpoint.save=null", f"logging.tensorboard_dir={root / 'tb'}",
                            f"logging.log_dir={root / 'logs'}", *OPTIONS],
                        config=ROOT / "configs" / "tiny_moe.yaml", module="tests.workers.moe_options_worker",
                        env={"MOE_LOG": str(root / "moe.jsonl")})
    steps = [json.loads(line) for line in (root / "moe.jsonl").read_text().splitlines()]
    return proc.stdout + proc.stderr, steps, root / "tb"


def test_the_run_says_what_routes(run):
    log, steps, _ = run
    assert ("top-2 (sigmoid)" in log and "seq_aux_loss × 0.01, expert bias" in log
            and "capacity factor 1 (probs)" in log), log[-3000:]
    assert [s["iteration"] for s in steps] == [1, 2, 3] and len(steps[0]["kept"]) == 4  # 4 MoE layers


def test_the_expert_bias_moves_against_each_experts_load(run):
    """megatron-core's update after each step: bias += rate · sign(mean load − load), over the step's kept tokens."""
    _, steps, _ = run
    for step in steps:
        for kept, before, after in zip(step["kept"], step["bias_before"], step["bias_after"]):
            load = [sum(micro[e] for micro in kept) for e in range(EXPERTS)]
            mean = sum(load) / EXPERTS
            want = [b + RATE * ((mean > x) - (mean < x)) for b, x in zip(before, load)]
            assert after == pytest.approx(want, abs=1e-7), (step["iteration"], load, before, after)
    assert any(b != 0 for b in steps[-1]["bias_after"][0])


def test_no_expert_keeps_more_than_its_capacity_and_the_logged_drop_is_the_routings(run):
    _, steps, tb = run
    dropped = read_scalars(tb, "moe/dropped")
    for step in steps:
        shares = []
        for kept, tokens in zip(step["kept"], step["tokens"]):
            for micro, n in zip(kept, tokens):
                assert max(micro) <= math.ceil(n * TOPK / EXPERTS * CAPACITY_FACTOR), (step["iteration"], micro)
            shares.append(1 - sum(map(sum, kept)) / (sum(tokens) * TOPK))
        assert dropped[step["iteration"]] == pytest.approx(sum(shares) / len(shares), abs=1e-9)
    assert max(dropped.values()) > 0  # at factor 1 a random router drops some


def test_the_sequence_wise_aux_loss_is_the_one_trained(run):
    _, _, tb = run
    seq = read_scalars(tb, "moe/seq_load_balancing_loss")
    assert sorted(seq) == [1, 2, 3] and all(0 < v < 10 for v in seq.values()), seq
    assert read_scalars(tb, "moe/load_balancing_loss") == {}
