"""Checkpoints of Megatron-FSDP runs (fsdp_dtensor, :mod:`megatron_ext.checkpoint.fsdp_dtensor`) on CPU/gloo: a ZeRO-3
run stopped and resumed reproduces the uninterrupted one exactly (written in the background; the newest checkpoint
damaged, the one before it resumed); its checkpoint goes on under HSDP (DP4 in two groups, the optimizer state also
sharded across them), whose own checkpoint goes on under ZeRO-2 at another TP size (TP2 × DP2 + SP); retention, manifests and
``recipes.checkpoints`` treat it as any other; ``recipes.convert export-hf`` reads it; a run without Megatron-FSDP
refuses it in one line; a Megatron-FSDP run starts from another run's weights. The runs mask documents in their
packed sequences (data.reset_attention_mask and friends), so their resumes are exact with it on."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from megatron_ext.checkpoint.common_state import read_common
from megatron_ext.checkpoint.layout import TRACKER, iteration_dir, latest_iteration
from tests.conftest import parity_overrides
from tests.integration.test_training import RESHARD_TOLERANCE
from tests.launch import SINGLE_PROCESS, SMALL_MODEL, max_relative_difference, read_scalars, run_pretrain

STEPS, STOP = 5, 2
ZERO3 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
         "parallel.sequence_parallel=false", "parallel.use_megatron_fsdp=true"]
# document masking on in these runs: its resume (and resharded resume) must be exact too
DOCUMENTS = ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"]
TAGS = ("train/lm_loss", "train/grad_norm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """ZeRO-3 at DP2: uninterrupted (saving every STOP steps, keeping the last), and stopped at STOP, then resumed."""
    root = tmp_path_factory.mktemp("fsdp")
    run_pretrain(2, [*parity_overrides(None, root / "tb_full", STEPS), *ZERO3, *DOCUMENTS,
                     f"checkpoint.save={root / 'full'}",
                     f"checkpoint.save_interval={STOP}", "checkpoint.keep_last=1"])
    interrupted = [*parity_overrides(None, root / "tb_resumed", STEPS), *ZERO3, *DOCUMENTS,
                   f"checkpoint.save={root / 'ckpt'}"]
    run_pretrain(2, [*interrupted, f"train.exit_interval={STOP}", "checkpoint.async_save=true",
                     "checkpoint.save_interval=1"])
    shutil.copytree(root / "ckpt", root / "at_stop")
    # the newest checkpoint damaged (a shard cut short, as by a full disk): the resume falls back to the one before
    shard = next((root / "ckpt" / f"iter_{STOP:07d}").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = run_pretrain(2, interrupted)
    return {"root": root, "full": root / "tb_full", "resumed": root / "tb_resumed", "at_stop": root / "at_stop",
            "resumed_log": resumed.stdout + resumed.stderr}


def test_zero3_resume_reproduces_the_uninterrupted_run_exactly(runs):
    """Through the corrupt-checkpoint fallback: the newest checkpoint (a shard cut short) is set aside and the one
    before it resumed."""
    log = runs["resumed_log"]
    assert "packed documents: attention within each document (SDPA's boolean mask (CPU)); positions and RoPE " \
           "restart at each document; no loss where the input token is EOD" in log, log[-3000:]
    assert "CHECKPOINT NOT USABLE" in log and "truncated" in log and f"at iteration {STOP - 1}" in log, log[-3000:]
    for tag in TAGS:
        full, resumed = read_scalars(runs["full"], tag), read_scalars(runs["resumed"], tag)
        assert sorted(resumed) == list(range(1, STEPS + 1)), tag
        assert {k: resumed[k] for k in range(STOP, STEPS + 1)} == {k: full[k] for k in range(STOP, STEPS + 1)}, tag
    common = read_common(iteration_dir(runs["at_stop"], STOP))
    assert common.optimizer_format == "fsdp_dtensor" and common.iteration == STOP and common.version == 1


def test_retention_and_listing_treat_it_as_any_checkpoint(runs):
    from recipes.checkpoints import describe

    full = runs["root"] / "full"
    assert latest_iteration(full) == STEPS and not iteration_dir(full, STOP).exists()  # keep_last=1
    lines, newest = describe(full, verify=True)
    assert newest == iteration_dir(full, STEPS)
    assert "complete, verified" in lines[0] and "Megatron-FSDP optim_grads_params" in lines[0], lines


def test_zero3_checkpoint_continues_under_hsdp_whose_checkpoint_continues_under_zero2_at_another_tp_size(runs, tmp_path):
    """The ZeRO-3 checkpoint of TP1 × DP2 at step STOP, continued for one step under HSDP (ZeRO-3 within 2 groups of
    2 DP ranks, the optimizer state also sharded across them), which saves; that checkpoint continued under ZeRO-2 at
    TP2 × DP2 with sequence parallelism to the end: each step the uninterrupted run's within the reshard bounds (the
    second is also the parity matrix's ZeRO-2 case)."""
    hsdp = STOP + 1
    legs = (("HSDP at DP4", runs["at_stop"], tmp_path / "hsdp",
             ["parallel.num_distributed_optimizer_instances=2", "parallel.outer_dp_sharding_strategy=optim",
              f"train.exit_interval={hsdp}"],
             ["TP1 × CP1 × DP4 × PP1", "over each of 2 HSDP groups of 2 DP×CP ranks (this rank's: [0, 1]), the "
              "optimizer state also sharded across them"], range(STOP + 1, hsdp + 1)),
            ("ZeRO-2 at TP2 × DP2 + SP", tmp_path / "hsdp", tmp_path / "zero2",
             ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
              "parallel.data_parallel_sharding_strategy=optim_grads"],
             ["TP2 × CP1 × DP2 × PP1", "Megatron-FSDP optim_grads (ZeRO-2) over DP×CP=2"], range(hsdp + 1, STEPS + 1)))
    for name, load, save, layout, expected, steps in legs:
        tb = tmp_path / f"tb_{save.name}"
        proc = run_pretrain(4, [*parity_overrides(None, tb, STEPS), *ZERO3, *DOCUMENTS, *layout,
                                f"checkpoint.load={load}", f"checkpoint.save={save}"])
        log = proc.stdout + proc.stderr
        missing = [fragment for fragment in [*expected, f"resumed from {load} at iteration {steps.start - 1}"]
                   if fragment not in log]
        assert not missing, (name, missing, log[-3000:])
        for tag, tolerance in RESHARD_TOLERANCE.items():
            full = {k: v for k, v in read_scalars(runs["full"], tag).items() if k in steps}
            diff = max_relative_difference(read_scalars(tb, tag), full)
            print(f"reshard to {name}, {tag}: max rel diff {diff:.2e}")
            assert sorted(read_scalars(tb, tag)) == sorted(full) and diff <= tolerance, (name, tag)


def test_run_without_megatron_fsdp_refuses_it_in_one_line_before_any_rank_starts(runs, tmp_path):
    failed = run_pretrain(1, [*parity_overrides(None, tmp_path / "tb", STEPS), *SINGLE_PROCESS,
                              f"checkpoint.load={runs['at_stop']}", f"checkpoint.save={tmp_path / 'ckpt'}"],
                          check=False)
    lines = [line for line in (failed.stdout + failed.stderr).splitlines() if "checkpoint error" in line]
    assert failed.returncode != 0 and len(lines) == 1, failed.stderr[-2000:]
    assert "saved by a Megatron-FSDP run (fsdp_dtensor format)" in lines[0]
    assert "parallel.use_megatron_fsdp=true" in lines[0] and "export-hf" in lines[0]
    assert "rank" not in lines[0] and not (tmp_path / "ckpt").exists()  # said by the launcher, no rank started


def test_starts_from_weights_and_export_hf_reads_them_back_bit_for_bit(initial_weights, megatron, tmp_path):
    """A ZeRO-3 run of another seed started from `initial_weights` (1 process, torch_dist) and stopped at step 0
    holds exactly those weights (loaded before Megatron-FSDP shards them): both checkpoints export to the same
    Hugging Face tensors, bit for bit."""
    from safetensors.torch import load_file

    from recipes.convert import export_hf

    started = run_pretrain(2, [*SMALL_MODEL, *ZERO3, "train.train_iters=0", "train.seed=4321",
                               f"checkpoint.pretrained_checkpoint={initial_weights}",
                               f"checkpoint.save={tmp_path / 'zero3'}"])
    assert f"loaded weights of {initial_weights}" in started.stdout + started.stderr
    assert (tmp_path / "zero3" / TRACKER).is_file()
    exported = {}
    for name, ckpt in (("zero3", tmp_path / "zero3"), ("reference", initial_weights)):
        megatron(export_hf, ckpt, tmp_path / f"hf_{name}")
        exported[name] = load_file(str(tmp_path / f"hf_{name}" / "model.safetensors"))
    assert sorted(exported["zero3"]) == sorted(exported["reference"])
    for key, tensor in exported["reference"].items():
        assert (exported["zero3"][key] == tensor).all(), key
