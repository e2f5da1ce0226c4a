"""Mixture-of-Experts end to end on CPU/gloo (fp32, dropless routing, so no token's fate depends on how the experts
are split): every expert layout trains the same MoE model as one process, a resume is exact, and a checkpoint
continues under another expert layout.

The model is configs/tiny_moe.yaml at the parity matrix's small size (8 experts, top-2, aux-loss balancing). Each
layout loads the same initial weights (saved at EP1: every layout also proves EP1 → EPn weight loading), trains the
same global batches, and must match the single-process run's loss, grad norm and load-balancing loss step by step;
its start-up log must show the experts split as asked, read from the built model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_ext.checkpoint.layout import iteration_dir, write_tracker
from tests.conftest import PARITY_STEPS, parity_overrides
from tests.integration.test_parallel_parity import TOLERANCE
from tests.integration.test_training import RESHARD_TOLERANCE
from tests.launch import ROOT, SINGLE_PROCESS, max_relative_difference, read_scalars, run_pretrain

TINY_MOE = ROOT / "configs" / "tiny_moe.yaml"
STEPS, STOP = PARITY_STEPS, 3
SINGLE = [*SINGLE_PROCESS, "parallel.expert_model_parallel_size=1"]
AUX = "moe/load_balancing_loss"
# the load-balancing loss sums per-expert products of token fractions and mean probabilities: its order of sums
# changes with the split like the grad norm's (measured ≤ 3.1e-7)
# the routers' token counts are integers: every layout routes every token to the same experts (dropless), so their
# statistics are equal up to the rounding of the shares
MOE_TOLERANCE = {**TOLERANCE, AUX: 2e-6, "moe/max_load": 1e-12, "moe/load_cv": 1e-12}
TP1 = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"]
PP1 = ["parallel.pipeline_model_parallel_size=1"]

LAYOUTS = {
    # name: (processes, overrides on top of configs/tiny_moe.yaml (EP2×PP2), what the start-up log must say)
    # each expert's matrices split over TP2 too (expert TP = TP), the tokens sequence-parallel between the layers
    "ep2_tp2_sp": (4, [*PP1, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
                   ["TP2 × CP1 × DP2 × PP1", "expert layers: world=4 = ETP2 × EP2 × expert-DP1 × PP1",
                    "experts [0, 1, 2, 3] on ranks [0, 1]; experts [4, 5, 6, 7] on ranks [2, 3]",
                    "kernels: sequence parallel"]),
    # expert-DP 2: the experts' optimizer state sharded over it, the dense parameters' over DP4
    "dp4_ep2_distopt": (4, [*TP1, *PP1], ["TP1 × CP1 × DP4 × PP1", "ETP1 × EP2 × expert-DP2 × PP1",
                                         "experts [0, 1, 2, 3] on ranks [0, 2]",
                                         "distributed optimizer (state sharded over DP×CP=4)"]),
}
# the routing-collapse warning at the even share itself (2 of 8 experts), so that the run's own routing trips it:
# which layers warn, when and with what share must follow from the logged per-layer loads
COLLAPSE_SHARE, COLLAPSE_INTERVALS = 0.25, 2
COLLAPSE = [f"logging.moe_collapse_share={COLLAPSE_SHARE}", f"logging.moe_collapse_intervals={COLLAPSE_INTERVALS}"]
FULL_LAYOUT = ["TP1 × CP1 × DP2 × PP2", "expert layers: world=4 = ETP1 × EP2 × expert-DP1 × PP2",
               "experts [0, 1, 2, 3] on ranks [0, 2]; experts [4, 5, 6, 7] on ranks [1, 3]",
               "MoE: 8 experts per layer, top-2 (softmax); 4 on this rank as SequentialMLP; alltoall dispatcher; "
               "aux_loss × 0.01; dropless"]


def _missing(log: str, expected: list[str]) -> list[str]:
    return [fragment for fragment in expected if fragment not in log]


def _assert_matches(tb: Path, reference: Path, tolerances: dict[str, float], steps: range, name: str) -> None:
    for tag, tolerance in tolerances.items():
        measured = read_scalars(tb, tag)
        assert sorted(measured) == list(steps), (name, tag, measured)
        want = {k: v for k, v in read_scalars(reference, tag).items() if k in steps}
        diff = max_relative_difference(measured, want)
        print(f"MoE {name} {tag}: max rel diff {diff:.2e}")
        assert diff <= tolerance, (name, tag, measured, want)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Initial weights (EP1); the 1-process run; EP2×PP2 uninterrupted, saving at STOP (in the format that reshards
    to any layout); and that checkpoint alone, as a run stopped there leaves it, resumed."""
    root = tmp_path_factory.mktemp("moe")
    init = root / "init"
    run_pretrain(1, [*parity_overrides(None, root / "unused", 0), *SINGLE, f"checkpoint.save={init}",
                     "logging.tensorboard_dir=null"], config=TINY_MOE)

    def overrides(tb: str) -> list[str]:
        return [*parity_overrides(init, root / tb, STEPS), "checkpoint.save=null"]

    run_pretrain(1, [*overrides("single"), *SINGLE], config=TINY_MOE)
    full = run_pretrain(4, [*overrides("full"), f"checkpoint.save={root / 'saved'}", f"checkpoint.save_interval={STOP}",
                            "checkpoint.optimizer_format=fully_reshardable", *COLLAPSE], config=TINY_MOE)
    ckpt = root / "ckpt"
    shutil.copytree(iteration_dir(root / "saved", STOP), iteration_dir(ckpt, STOP))
    write_tracker(ckpt, STOP)
    run_pretrain(4, [*overrides("resumed"), f"checkpoint.load={ckpt}"], config=TINY_MOE)
    return {"init": init, "single": root / "single", "full": root / "full", "resumed": root / "resumed",
            "ckpt": ckpt, "full_log": full.stdout + full.stderr}


def test_ep2_pp2_matches_single_process_and_its_loss_falls(runs):
    assert not _missing(runs["full_log"], FULL_LAYOUT), runs["full_log"][:4000]
    _assert_matches(runs["full"], runs["single"], MOE_TOLERANCE, range(1, STEPS + 1), "ep2_pp2")
    losses = read_scalars(runs["full"], "train/lm_loss")
    assert losses[STEPS] < losses[1] - 0.5, losses


def test_the_routing_collapse_warning_follows_the_logged_loads_through_the_loop(runs):
    """Through the real loop at EP2×PP2 (the loads reduced over both stages): a warning for each layer whose
    busiest expert stayed above the share for COLLAPSE_INTERVALS log intervals in a row, in order, with its share."""
    import re

    expected, streak = [], {}
    for step in range(1, STEPS + 1):
        for layer in range(1, 5):
            load = read_scalars(runs["full"], f"moe/layer{layer}/max_load")[step]
            streak[layer] = streak.get(layer, 0) + 1 if load > COLLAPSE_SHARE else 0
            if streak[layer] == COLLAPSE_INTERVALS:
                expected.append((layer, round(100 * load)))
    said = [(int(layer), int(share)) for layer, share in
            re.findall(r"routing collapse in MoE layer (\d+): expert \d+ took (\d+)% of the layer's tokens",
                       runs["full_log"])]
    assert expected and said == expected, (said, expected)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_layout_matches_single_process(name, runs, tmp_path):
    nproc, layout, expected = LAYOUTS[name]
    proc = run_pretrain(nproc, [*parity_overrides(runs["init"], tmp_path / "tb", STEPS), *layout,
                                "checkpoint.save=null"], config=TINY_MOE)
    log = proc.stdout + proc.stderr
    assert not _missing(log, expected), f"{name}: the start-up log does not show {_missing(log, expected)}:\n{log}"
    _assert_matches(tmp_path / "tb", runs["single"], MOE_TOLERANCE, range(1, STEPS + 1), name)


def test_resume_reproduces_the_uninterrupted_run_exactly(runs):
    for tag in ("train/lm_loss", "train/grad_norm", AUX, "moe/load_cv"):
        full, resumed = read_scalars(runs["full"], tag), read_scalars(runs["resumed"], tag)
        assert sorted(resumed) == list(range(STOP + 1, STEPS + 1)), tag
        assert {k: resumed[k] for k in range(STOP + 1, STEPS + 1)} == {k: full[k] for k in range(STOP + 1, STEPS + 1)}


def test_checkpoints_move_between_the_local_and_te_layer_specs(runs, tmp_path):
    """The local EP2×PP2 checkpoint at STOP resumed under TransformerEngine's layer spec (TE-shaped stand-ins:
    megatron-core's TEGroupedMLP over grouped linears with TE's checkpoint contract) at EP2×DP2, saved there two
    steps later and resumed under the local spec in one process: every step the uninterrupted run's."""
    te_ckpt = tmp_path / "te_ckpt"
    proc = run_pretrain(2, [*parity_overrides(None, tmp_path / "te", STEPS), *TP1, *PP1, "model.attention_backend=te",
                            f"checkpoint.load={runs['ckpt']}", f"checkpoint.save={te_ckpt}",
                            f"train.exit_interval={STOP + 2}", "checkpoint.optimizer_format=fully_reshardable"],
                        module="tests.workers.te_standin", config=TINY_MOE)
    log = proc.stdout + proc.stderr
    expected = ["layer spec: TransformerEngine", "4 on this rank as TEGroupedMLP",
                f"resumed from {runs['ckpt']} at iteration {STOP}"]
    assert not _missing(log, expected), f"the start-up log does not show {_missing(log, expected)}:\n{log[-4000:]}"
    _assert_matches(tmp_path / "te", runs["full"], {**MOE_TOLERANCE, **RESHARD_TOLERANCE},
                    range(STOP + 1, STOP + 3), "local to TE")
    proc = run_pretrain(1, [*parity_overrides(None, tmp_path / "local", STEPS), *SINGLE, "checkpoint.save=null",
                            f"checkpoint.load={te_ckpt}"], config=TINY_MOE)
    log = proc.stdout + proc.stderr
    assert f"resumed from {te_ckpt} at iteration {STOP + 2}" in log and "as SequentialMLP" in log, log[-3000:]
    _assert_matches(tmp_path / "local", runs["full"], {**MOE_TOLERANCE, **RESHARD_TOLERANCE},
                    range(STOP + 3, STEPS + 1), "TE to local")


@pytest.mark.parametrize("name, nproc, layout, expected", [
    # EP2 → EP1 (every expert on every rank), PP2 → PP1, TP1 → TP2
    ("ep1_tp2_sp", 2, [*PP1, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                       "parallel.expert_model_parallel_size=1"],
     ["expert layers: world=2 = ETP2 × EP1 × expert-DP1 × PP1", "experts [0, 1, 2, 3, 4, 5, 6, 7] on ranks [0, 1]"]),
    # EP2 → EP4 at DP4, with the other token dispatcher
    ("dp4_ep4_allgather", 4, [*TP1, *PP1, "parallel.expert_model_parallel_size=4",
                              "model.moe_token_dispatcher_type=allgather"],
     ["ETP1 × EP4 × expert-DP1 × PP1", "experts [6, 7] on ranks [3]", "2 on this rank as SequentialMLP; allgather "
      "dispatcher"]),
])
def test_checkpoint_continues_under_another_expert_layout(runs, name, nproc, layout, expected, tmp_path):
    """The EP2×PP2 checkpoint at STOP, resumed resharded: the same run's steps after it."""
    proc = run_pretrain(nproc, [*parity_overrides(None, tmp_path / "tb", STEPS), *layout, "checkpoint.save=null",
                                f"checkpoint.load={runs['ckpt']}"], config=TINY_MOE)
    log = proc.stdout + proc.stderr
    assert not _missing(log, expected), f"{name}: the start-up log does not show {_missing(log, expected)}:\n{log}"
    assert f"resumed from {runs['ckpt']} at iteration {STOP}" in log, log[-3000:]
    _assert_matches(tmp_path / "tb", runs["full"], {**MOE_TOLERANCE, **RESHARD_TOLERANCE},
                    range(STOP + 1, STEPS + 1), f"reshard {name}")


def test_forced_load_balancing_routes_evenly_in_cpu_rehearsal(tmp_path):
    """model.moe_router_force_load_balancing (benchmark mode: megatron-core's router scores replaced by random ones)
    runs in one CPU process, the start-up line says so, and the busiest expert's share comes out near the even
    top-2-of-8 share (0.25), where the trained router's does not."""
    common = [*SINGLE, "train.train_iters=4", "train.eval_iters=0", "logging.log_interval=2", "checkpoint.save=null",
              "checkpoint.load=null"]
    busiest = {}
    for forced in (False, True):
        tb = tmp_path / f"tb_{forced}"
        proc = run_pretrain(1, [*common, f"model.moe_router_force_load_balancing={str(forced).lower()}",
                                f"logging.tensorboard_dir={tb}", f"logging.log_dir={tmp_path / f'logs_{forced}'}"],
                            config=TINY_MOE)
        assert ("FORCED load balancing (benchmark mode" in proc.stdout) == forced, proc.stdout[-3000:]
        busiest[forced] = max(read_scalars(tb, "moe/max_load").values())
    assert busiest[True] < 0.3 < busiest[False], busiest
