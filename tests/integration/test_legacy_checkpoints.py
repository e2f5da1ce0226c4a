"""Checkpoints written by the previous stack (megatron-core 0.16.1, Python 3.11, torch 2.13.0+cpu: the common state in
``common.pt``) keep working on this one: each resumes and continues the loss curve of the run that wrote it, next to a
checkpoint in the current layout (the common state inside the torch_dist shards) that ``recipes.checkpoints`` lists
beside it; a damaged common state of either layout is one line; ``export-hf`` and ``generate`` read them.

The fixtures (``tests/legacy_checkpoints/*``, README.md there says how they were made) hold the step-2 checkpoint of a
4-step run and that run's losses and gradient norms: dense in both distributed-optimizer formats (dp_reshardable
written asynchronously), MoE at EP2, and Megatron-FSDP ZeRO-3 (fsdp_dtensor).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.checkpoint.common_state import read_common
from megatron_ext.checkpoint.layout import COMMON_STATE, iteration_dir
from megatron_ext.config.schema import load_config
from megatron_ext.errors import CheckpointError
from tests.integration.test_training import RESHARD_TOLERANCE
from tests.launch import (
    ROOT,
    SINGLE_PROCESS,
    launch_prefix,
    max_relative_difference,
    read_scalars,
    run_env,
    run_pretrain,
)

FIXTURES = ROOT / "tests" / "legacy_checkpoints"
CASES = sorted(path.name for path in FIXTURES.iterdir() if (path / "uninterrupted.json").is_file())
# the fully reshardable format resumed under another layout: TP2 -> one process
RESUMED_UNDER = {"dense_fully_reshardable": (1, SINGLE_PROCESS)}
# Under the layout that saved it, within a few fp32 ulps of the run that wrote it: bit for bit on the CPU the fixtures
# were made on (0 on every step, the CPU build of torch 2.13 there and its CUDA build here) but for the gradient norm,
# which megatron-core now finishes on the device (an fp32 pow, training/optimizer.py:keep_grad_norm_on_device) where
# the fixtures' run read it to the host first (a float64 square root: 1 ulp on one step of the ZeRO-3 case). On an
# AVX-512 Xeon (2026-11-27) the loss moves by 0.7 ulp and the gradient norm by 1.2 ulps on one step: torch's CPU kernels
# sum in an order that follows the vector width. A resume that gets the state wrong moves them by hundreds: an LR
# decay horizon of 21 instead of 20 steps, 480-500 ulps on the loss and 2,500-4,000 on the gradient norm (measured).
# Resharded, within the bounds of a resharded resume on one stack (measured 8.3e-8 / 1.6e-7).
FP32_ULP = 2.0 ** -23
SAME_LAYOUT_ULPS = 4


def _copy(case: str, tmp_path: Path) -> tuple[dict, Path]:
    ckpt = tmp_path / case
    shutil.copytree(FIXTURES / case / "checkpoints", ckpt)
    return json.loads((FIXTURES / case / "uninterrupted.json").read_text()), ckpt


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_of_the_previous_stack_continues_its_run(case, tmp_path):
    from recipes.checkpoints import describe

    run, ckpt = _copy(case, tmp_path)
    tb = _resume_and_compare(case, run, ckpt, tmp_path, [])
    if case in NEW_SCHEDULE_CASES:
        _resumes_under_a_new_schedule(case, run, tmp_path, read_scalars(tb, "train/lr"))
    # the legacy checkpoint and the one this run saved (no common.pt but Megatron-FSDP's) listed alike
    lines, newest = describe(ckpt, verify=True)
    assert newest == iteration_dir(ckpt, run["steps"]) and len(lines) == 2, lines
    assert all("complete, verified" in line and "unreadable" not in line and "TP" in line for line in lines), lines
    assert (iteration_dir(ckpt, run["steps"]) / COMMON_STATE).is_file() == (case == "fsdp_zero3")
    # a damaged common state is one line in either layout: common.pt cut short, or the shards that hold it
    for directory in (iteration_dir(ckpt, run["saved_at"]), iteration_dir(ckpt, run["steps"])):
        holders = [directory / COMMON_STATE] if (directory / COMMON_STATE).is_file() else directory.glob("*.distcp")
        for holder in holders:
            holder.write_bytes(holder.read_bytes()[:100])
        with pytest.raises(CheckpointError) as refused:
            read_common(directory)
        assert "\n" not in str(refused.value) and f"{directory}: " in str(refused.value), refused.value


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_of_the_previous_stack_continues_its_run_as_a_hybrid_model(case, tmp_path):
    """megatron-core's HybridModel (model.model_class=hybrid) resumes GPTModel's checkpoints: each continues the run
    that wrote it as closely as GPTModel does (checkpoint/model_class.py)."""
    run, ckpt = _copy(case, tmp_path)
    _resume_and_compare(case, run, ckpt, tmp_path, ["model.model_class=hybrid"])


def _resume_and_compare(case: str, run: dict, ckpt: Path, tmp_path: Path, extra: list[str]) -> Path:
    """Resume the fixture checkpoint `ckpt` of `case` (under RESUMED_UNDER's layout, else its own) with `extra`
    overrides and hold its losses and gradient norms to the run that wrote it; the TensorBoard directory."""
    nproc, layout = RESUMED_UNDER.get(case, (run["nproc"], []))
    tb = tmp_path / "tb"
    proc = run_pretrain(nproc, [*run["overrides"], *layout, *extra, f"checkpoint.load={ckpt}",
                                f"checkpoint.save={ckpt}", f"logging.tensorboard_dir={tb}"])
    assert f"resumed from {ckpt} at iteration {run['saved_at']}" in proc.stdout, proc.stdout[-3000:]
    for tag, tolerance in RESHARD_TOLERANCE.items():
        expected = {int(step): value for step, value in run[tag].items() if int(step) > run["saved_at"]}
        resumed = read_scalars(tb, tag)
        if case in RESUMED_UNDER:
            worst = max_relative_difference(resumed, expected)
            assert worst <= tolerance, f"{tag}: {worst:.2e}"
        else:
            worst = max_relative_difference(resumed, expected)  # over the same steps
            assert worst <= SAME_LAYOUT_ULPS * FP32_ULP, f"{tag}: {worst / FP32_ULP:.1f} ulps"
    return tb


# the distributed optimizer's param groups, and Megatron-FSDP's per-parameter groups
NEW_SCHEDULE_CASES = ("dense_dp_reshardable_async", "fsdp_zero3")


def _resumes_under_a_new_schedule(case: str, run: dict, tmp_path: Path, lr: dict[int, float]) -> None:
    """optimizer.lr and min_lr doubled for the resume: it trains on at twice the LR of every step (megatron-core 0.19
    paired the saved param groups by their old LR, and the load failed with a bare KeyError; under Megatron-FSDP the
    saved LR won over the config's without a word)."""
    ckpt = tmp_path / "new-schedule"
    shutil.copytree(FIXTURES / case / "checkpoints", ckpt)
    tb = tmp_path / "tb-new-schedule"
    cfg = load_config(ROOT / "configs" / "tiny.yaml", run["overrides"])
    proc = run_pretrain(run["nproc"], [*run["overrides"], f"optimizer.lr={2 * cfg.optimizer.lr}",
                                       f"optimizer.min_lr={2 * cfg.optimizer.min_lr}", f"checkpoint.load={ckpt}",
                                       f"checkpoint.save={ckpt}", f"logging.tensorboard_dir={tb}"])
    assert f"resumed from {ckpt} at iteration {run['saved_at']}" in proc.stdout, proc.stdout[-3000:]
    doubled = read_scalars(tb, "train/lr")
    assert sorted(doubled) == sorted(lr) and all(doubled[s] == pytest.approx(2 * lr[s], rel=1e-6) for s in lr), \
        (doubled, lr)


def test_export_and_generate_read_a_checkpoint_of_the_previous_stack(tmp_path):
    from transformers import AutoModelForCausalLM

    from data_prep.train_tokenizer import train_tokenizer

    _, ckpt = _copy("dense_fully_reshardable", tmp_path)
    out = tmp_path / "hf"
    convert = subprocess.run([sys.executable, *launch_prefix(1), "-m", "recipes.convert", "export-hf", "--checkpoint", str(ckpt),
                              "--output", str(out)], cwd=ROOT, env=run_env(), capture_output=True, text=True)
    assert convert.returncode == 0, convert.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.num_hidden_layers == 2 and exported.config.hidden_size == 64
    # a tokenizer of the model's vocabulary size (512), from the default corpus (make data)
    tokenizer = train_tokenizer([str(ROOT / "data" / "tiny" / "stdlib.jsonl")], 512, "bpe", str(tmp_path / "tok")).model_path
    generate = subprocess.run([sys.executable, *launch_prefix(1), "-m", "recipes.generate", "--checkpoint", str(ckpt), "--prompt", "def",
                               "--max-new-tokens", "4", "--tokenizer", tokenizer],
                              cwd=ROOT, env=run_env(), capture_output=True, text=True)
    assert generate.returncode == 0 and "iter_0000002" in generate.stderr, generate.stderr[-3000:]


def test_the_listing_names_a_changed_model_in_a_checkpoint_of_the_previous_stack(capsys):
    """What a resume would refuse (recipes.checkpoints --config: the shape check a resume runs, from the saved config
    of a common.pt)."""
    from recipes.checkpoints import main

    run = json.loads((FIXTURES / "moe_ep2" / "uninterrupted.json").read_text())
    overrides = [*run["overrides"], "model.hidden_size=128"]
    assert main([str(FIXTURES / "moe_ep2" / "checkpoints"), "--config", str(ROOT / "configs" / "tiny.yaml"),
                 *overrides]) == 0
    out = capsys.readouterr().out
    assert "iter_0000002" in out and "optimizer dp_reshardable" in out, out
    assert "model.hidden_size: 64 → 128" in out, out
    assert "a resume would be refused: parameter shapes differ (model.hidden_size: 64 → 128" in out, out
