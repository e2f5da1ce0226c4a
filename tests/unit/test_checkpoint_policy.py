"""The checkpoint manager's decisions, as pure functions: when a save is due, which optimizer format it writes,
which checkpoints retention keeps, and the typed common state every checkpoint holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.checkpoint.layout import MANIFEST, complete_iterations, iteration_dir, iteration_dirs
from megatron_ext.checkpoint.manager import optimizer_format_for, save_due
from megatron_ext.checkpoint.retention import apply_retention
from megatron_ext.config.schema import load_config
from tests.launch import TINY


def test_a_save_is_due_every_interval_at_a_stop_and_at_the_end():
    cfg = load_config(TINY, ["train.train_iters=10", "checkpoint.save_interval=4"])
    assert [i for i in range(1, 11) if save_due(cfg, i, stopping=False)] == [4, 8, 10]
    assert save_due(cfg, 3, stopping=True)
    no_interval = load_config(TINY, ["train.train_iters=0"])
    assert save_due(no_interval, 0, stopping=False)  # a 0-step run saves its initial weights


def test_auto_format_is_lean_along_the_way_and_fully_reshardable_at_the_end():
    cfg = load_config(TINY, ["train.train_iters=10"])
    assert [optimizer_format_for(cfg, i) for i in (4, 10, 12)] == [
        "dp_reshardable", "fully_reshardable_mem_efficient", "fully_reshardable_mem_efficient"]
    assert optimizer_format_for(load_config(TINY, ["checkpoint.optimizer_format=fully_reshardable"]), 4) == \
        "fully_reshardable"
    plain = load_config(TINY, ["parallel.use_distributed_optimizer=false", "checkpoint.optimizer_format=dp_reshardable"])
    assert optimizer_format_for(plain, 4) == "fully_reshardable"


def _complete(root: Path, *iterations: int) -> None:
    for i in iterations:
        iteration_dir(root, i).mkdir(parents=True)
        (iteration_dir(root, i) / MANIFEST).write_text("{}")


def test_retention_keeps_the_newest_n_every_kth_and_never_partial_or_set_aside_ones(tmp_path):
    _complete(tmp_path, 1, 2, 3, 4, 5, 6)
    (tmp_path / "iter_0000007").mkdir()  # partial: no manifest yet
    (tmp_path / "iter_0000002.corrupt").mkdir()
    assert apply_retention(tmp_path, latest=6, keep_last=2, keep_every=3) == [1, 2, 4]
    assert complete_iterations(tmp_path) == [3, 5, 6]
    assert [(d.iteration, d.set_aside) for d in iteration_dirs(tmp_path)] == [
        (2, True), (3, False), (5, False), (6, False), (7, False)]
    assert apply_retention(tmp_path, latest=6, keep_last=None, keep_every=None) == []


def test_a_checkpoint_resumes_only_in_a_run_of_its_own_data_parallel_kind():
    """fsdp_dtensor training state only under Megatron-FSDP, torch_dist only without it; weights only (an import)
    under either (a Megatron-FSDP run loads them before it shards them)."""
    from megatron_ext.checkpoint.common_state import CommonState
    from megatron_ext.checkpoint.save_load import format_mismatch

    ckpt = Path("iter_0000002")
    fsdp, zero1 = (CommonState(2, 16, {}, optimizer_format=kind) for kind in ("fsdp_dtensor", "dp_reshardable"))
    imported = CommonState(0, 0, {}, "weights_only")
    assert format_mismatch(ckpt, fsdp, use_megatron_fsdp=True) is None
    assert format_mismatch(ckpt, zero1, use_megatron_fsdp=False) is None
    assert format_mismatch(ckpt, imported, use_megatron_fsdp=False) is None
    assert "saved by a Megatron-FSDP run" in format_mismatch(ckpt, fsdp, use_megatron_fsdp=False)
    assert "saved by a run without Megatron-FSDP" in format_mismatch(ckpt, zero1, use_megatron_fsdp=True)
    assert format_mismatch(ckpt, imported, use_megatron_fsdp=True) is None


def test_retention_that_cannot_delete_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    import logging
    import shutil

    for i in range(1, 5):
        _complete(tmp_path, i)

    def busy(path, *args, **kwargs):
        raise OSError(16, "Device or resource busy", str(path / ".nfs0000000001"))

    monkeypatch.setattr(shutil, "rmtree", busy)
    with caplog.at_level(logging.WARNING):
        assert apply_retention(tmp_path, latest=4, keep_last=2, keep_every=None) == []
    assert "retention could not delete" in caplog.text and "training goes on" in caplog.text


def test_the_common_state_round_trips_and_a_malformed_one_is_one_line(tmp_path):
    from megatron_ext.checkpoint.common_state import VERSION, CommonState
    from megatron_ext.errors import CheckpointError

    state = CommonState(7, 56, {"model": {}}, optimizer_format="dp_reshardable", buffer_layouts={"pp0-tp0": [1]})
    assert CommonState.from_saved(tmp_path, state.saved()) == state
    assert "rng_state" not in state.saved() and state.saved()["common_state_version"] == VERSION
    with pytest.raises(CheckpointError, match=r"has no int 'iteration' \(found NoneType\)"):
        CommonState.from_saved(tmp_path, {"config": {}})
    with pytest.raises(CheckpointError, match=r"content='everything', expected"):
        CommonState.from_saved(tmp_path, {"iteration": 1, "config": {}, "content": "everything"})
    with pytest.raises(CheckpointError, match="is a list, not a mapping"):
        CommonState.from_saved(tmp_path, [1, 2])


@pytest.mark.parametrize("keys, mismatched, said", [
    ("[('optimizer', 'param_state')]", "[]", False),
    ("[('optimizer', 0, 'param_state'), ('optimizer', 1, 'param_state')]", "[]", False),
    ("[('optimizer', 'param_state')]", "[('iteration',)]", True),
    ("[('model', 'decoder')]", "[]", True),
])
def test_only_the_empty_optimizer_entry_of_other_dp_ranks_is_kept_out_of_the_log(keys, mismatched, said, caplog):
    """megatron-core's per-save comparison of every rank's common state with rank 0's: the known, harmless
    difference (the distributed optimizer's empty param_state on DP ranks > 0) is dropped; any other is said."""
    import logging

    import megatron_ext  # noqa: F401  (installs the filters)

    message = (f"Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], Keys only "
               f"on 1: {keys}, Mismatched keys: {mismatched}")
    logger = logging.getLogger("megatron.core.dist_checkpointing.validation")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning(message)
    assert (message in caplog.text) == said


def test_a_save_failing_where_other_ranks_wait_inside_megatron_core_names_its_cause_after_the_timeout(
        monkeypatch, tmp_path):
    """torch refuses a save plan on the coordinating rank alone while the others wait in megatron-core's barrier: the
    agreement on the failure times out, and the error still names what failed (not only the timeout)."""
    from megatron_ext.checkpoint import save_load
    from megatron_ext.errors import CheckpointError

    def timed_out(error):
        raise RuntimeError("[gloo] Timed out waiting 600000ms")

    def refused():
        raise ValueError("Failed to validate global plan")

    monkeypatch.setattr(save_load, "agreed_failure", timed_out)
    with pytest.raises(CheckpointError, match=r"failed on this rank while writing the shards \(ValueError: Failed to "
                                              r"validate global plan\), and the ranks that did not fail") as raised:
        save_load._on_every_rank(refused, tmp_path / "iter_0000002", "writing the shards")
    assert "Timed out" in str(raised.value.__cause__)
    with pytest.raises(RuntimeError, match="Timed out"):  # nothing failed here: the timeout is the news
        save_load._on_every_rank(lambda: None, tmp_path / "iter_0000002", "writing the shards")


def test_a_resume_follows_the_configs_schedule_in_each_saved_param_group_of_the_same_structure():
    """megatron-core 0.19 pairs saved and current param groups by max_lr/min_lr/start_wd/end_wd too: a resume with a
    new optimizer.lr found no group. The schedule's values now come from the current group of the same structure."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    from megatron_ext.checkpoint.compat import SCHEDULED, schedule_from_the_config

    assert set(SCHEDULED) <= set(param_group_identifier_keys)  # megatron-core's pairing key holds them

    def group(wd_mult: float, max_lr: float, expert: bool = False, **more) -> dict:
        return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": expert, "is_decoupled_lr": False,
                "max_lr": max_lr, "min_lr": max_lr / 10, "start_wd": 0.1, "end_wd": 0.1, "params": [0], **more}

    saved = [group(1.0, 3e-3), group(0.0, 3e-3), group(1.0, 3e-3, expert=True, step=7.0)]
    current = [group(0.0, 1e-3), group(1.0, 1e-3), group(1.0, 2e-3, expert=True)]
    schedule_from_the_config(saved, current)
    assert [(g["max_lr"], g["min_lr"]) for g in saved] == [(1e-3, 1e-4), (1e-3, 1e-4), (2e-3, 2e-4)]
    assert saved[2]["step"] == 7.0 and saved[0]["params"] == [0]  # the rest of the state is the checkpoint's
    # a structure whose current groups disagree is left for megatron-core's own pairing to judge
    saved = [group(1.0, 3e-3)]
    schedule_from_the_config(saved, [group(1.0, 1e-3), group(1.0, 2e-3)])
    assert saved[0]["max_lr"] == 3e-3
