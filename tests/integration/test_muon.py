"""Muon (optimizer.name=muon: megatron-core's, on emerging-optimizers' Newton-Schulz) trains the same model in every
layout as in one process (CPU, gloo), resumes exactly and into another DP size from its layer-wise distributed
optimizer's checkpoint, and QK-clip acts inside the loop.

fp32 without the distributed optimizer: TP2×PP2 with sequence parallelism against one process, then resumed from its
step-4 checkpoint at CP2×PP2×VPP2, within the parity matrix's fp32 bounds (test_parallel_parity.TOLERANCE) —
measured 1.1e-7 (loss) and 6.1e-6 (grad norm) at TP2×PP2, with
Newton-Schulz in full fp32 (optimizer.muon_fp32_matmul_prec=highest; at megatron-core's default `medium` the
layouts differ by 1e-4) and whole matrices orthogonalized (muon_tp_mode=duplicated; the default blockwise
orthogonalizes each TP shard on its own, another optimizer by design: 6e-3 apart at TP2).
bf16 with the layer-wise distributed optimizer (Muon's only distributed optimizer in megatron-core 0.19.2): DP2
against one process, 3.3e-5 and 1.2e-3 measured; resumed into one process from its step-4 checkpoint, 1.5e-5 and
1.1e-3 (bf16 weights: the order of DP's sums rounds differently); MoE at EP2 × DP2 against one process, 5.9e-5 and
1.6e-3 — bounds BF16_TOLERANCE."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import parity_overrides
from tests.integration.test_parallel_parity import TOLERANCE
from tests.launch import SINGLE_PROCESS, max_relative_difference, read_scalars, run_pretrain

FP32_MUON = ["optimizer.name=muon", "optimizer.muon_fp32_matmul_prec=highest", "optimizer.muon_tp_mode=duplicated",
             "parallel.use_distributed_optimizer=false", "parallel.overlap_param_gather=false"]
BF16_MUON = ["optimizer.name=muon", "train.precision=bf16"]
DP2 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
       "parallel.sequence_parallel=false"]
BF16_TOLERANCE = {"train/lm_loss": 1e-4, "train/grad_norm": 5e-3}


def _reference(initial_weights: Path, tb: Path, muon: list[str]) -> Path:
    run_pretrain(1, [*parity_overrides(initial_weights, tb), *muon, *SINGLE_PROCESS])
    return tb


def _assert_reproduces(reference: Path, tb: Path, tolerance: dict[str, float]) -> None:
    for tag, bound in tolerance.items():
        expected, got = read_scalars(reference, tag), read_scalars(tb, tag)
        assert set(got) <= set(expected) and got, (tag, sorted(got))
        difference = max_relative_difference({k: expected[k] for k in got}, got)
        print(f"{tag}: max relative difference {difference:.2e} over steps {sorted(got)}")
        assert difference <= bound, (tag, difference)


def test_tp2_pp2_and_cp2_pp2_vpp2_reproduce_one_process_through_a_resharded_resume(initial_weights, tmp_path):
    """TP2×PP2 with sequence parallelism for 4 steps, saved, then resumed at CP2×PP2 with two virtual stages each (TP1:
    each layer's momentum gathered whole from its TP shards, the layers regrouped into virtual stages) to the end:
    every step within the matrix's fp32 bounds of one process."""
    reference = _reference(initial_weights, tmp_path / "reference", FP32_MUON)
    checkpoint = [f"checkpoint.save={tmp_path / 'ckpt'}"]
    proc = run_pretrain(4, [*parity_overrides(initial_weights, tmp_path / "tp2_pp2", steps=4), *FP32_MUON, *checkpoint])
    assert "TP2 × CP1 × DP1 × PP2" in proc.stdout and "Muon on" in proc.stdout, proc.stdout[-2000:]
    proc = run_pretrain(4, [*parity_overrides(None, tmp_path / "cp2_vpp2"), *FP32_MUON, *checkpoint,
                            "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
                            "parallel.context_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"])
    assert "TP1 × CP2 × DP1 × PP2 (VPP2)" in proc.stdout and "resumed from" in proc.stdout, proc.stdout[-2000:]
    assert sorted(read_scalars(tmp_path / "cp2_vpp2", "train/lm_loss"))[0] == 5
    for tb in ("tp2_pp2", "cp2_vpp2"):
        _assert_reproduces(reference, tmp_path / tb, TOLERANCE)


def test_layer_wise_dp2_reproduces_one_process_and_resumes_into_it(initial_weights, tmp_path):
    reference = _reference(initial_weights, tmp_path / "reference", BF16_MUON)
    checkpoint = tmp_path / "ckpt"
    proc = run_pretrain(2, [*parity_overrides(initial_weights, tmp_path / "dp2", steps=4), *BF16_MUON, *DP2,
                            f"checkpoint.save={checkpoint}"])
    assert "layer-wise distributed optimizer (Muon's matrices whole, each on one of DP×CP=2 ranks)" in proc.stdout
    _assert_reproduces(reference, tmp_path / "dp2", BF16_TOLERANCE)
    # the finished run's checkpoint (fully reshardable) continues in one process: DP 2 → 1
    proc = run_pretrain(1, [*parity_overrides(None, tmp_path / "resumed"), *BF16_MUON, *SINGLE_PROCESS,
                            f"checkpoint.save={checkpoint}"])
    assert "resumed from" in proc.stdout and "DP 2 → 1" in proc.stdout, proc.stdout[-2000:]
    assert sorted(read_scalars(tmp_path / "resumed", "train/lm_loss")) == [5, 6]
    _assert_reproduces(reference, tmp_path / "resumed", BF16_TOLERANCE)


def test_qk_clip_rescales_the_weights_after_each_update(initial_weights, tmp_path):
    reference = _reference(initial_weights, tmp_path / "reference", BF16_MUON)
    run_pretrain(1, [*parity_overrides(initial_weights, tmp_path / "clipped", steps=3), *BF16_MUON, *SINGLE_PROCESS,
                     "model.qk_clip=true", "model.qk_clip_threshold=0.001"])
    expected, clipped = (read_scalars(tb, "train/lm_loss") for tb in (reference, tmp_path / "clipped"))
    assert clipped[1] == pytest.approx(expected[1], rel=1e-6)  # the first clip follows the first update
    # a cap of 0.001 (the small model's logits start near 0.01) moves the loss by 2.4e-4 at step 3 (measured); one
    # process is deterministic: without the clip it is the reference's to the bit
    assert abs(clipped[3] / expected[3] - 1) > 1e-5, (clipped, expected)


def test_moe_ep2_under_the_layer_wise_optimizer_reproduces_one_process(tmp_path):
    """configs/tiny_moe.yaml at the parity size: the experts' matrices Muon-stepped across EP2 (expert-DP1) and the
    dense ones across DP2, from the same initial weights as one process (saved at EP1)."""
    from tests.integration.test_moe import SINGLE, TINY_MOE

    init = tmp_path / "init"
    run_pretrain(1, [*parity_overrides(None, tmp_path / "unused", 0), *SINGLE, f"checkpoint.save={init}",
                     "logging.tensorboard_dir=null"], config=TINY_MOE)
    run_pretrain(1, [*parity_overrides(init, tmp_path / "reference"), *BF16_MUON, *SINGLE], config=TINY_MOE)
    proc = run_pretrain(2, [*parity_overrides(init, tmp_path / "ep2"), *BF16_MUON, *DP2,
                            "parallel.expert_model_parallel_size=2"], config=TINY_MOE)
    assert "ETP1 × EP2 × expert-DP1 × PP1" in proc.stdout and "layer-wise distributed optimizer" in proc.stdout
    _assert_reproduces(tmp_path / "reference", tmp_path / "ep2", BF16_TOLERANCE)
