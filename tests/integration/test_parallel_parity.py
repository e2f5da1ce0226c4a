"""The parity matrix: every 4D layout trains the same model as one process (CPU, gloo, fp32).

Each layout loads the same initial weights, trains the same global batches for 6 steps (5 updates reach the
last compared loss), must match the single-process run's per-step loss and grad-norm within TOLERANCE
(relative), and its start-up log must show that the feature it names was built.
TP2×PP2 and the resharded resumes are in test_training.py.
"""

from __future__ import annotations

import re
from typing import get_args

import pytest

from megatron_ext.config.schema import OffloadModule, data_parallel_size, load_config
from megatron_ext.planner import model_vocab_size, rank_static_bytes
from tests.conftest import PARITY_STEPS, parity_overrides
from tests.launch import TINY, max_relative_difference, read_scalars, run_pretrain

# fp32 on CPU: layouts change only the order of sums (TP all-reduces, DP/CP grad reduction, split
# softmax in ring attention); a real bug (wrong reduction, a layer missing on a stage, unmarked SP
# params, a wrong CP split) moves the loss by 1e-4 or more within 5 steps.
# Loss: measured worst 1.2e-7 over the matrix, bound 1e-6. Grad-norm: a global fp32 sum of
# squares whose decomposition into per-shard partial sums changes with TP/CP sharding; measured
# up to 7.9e-6 already at step 1 (identical weights), and Adam turns those differences into
# weight differences that grow over the steps: on the default corpus of Python 3.12's standard library
# the 16-process TP2×CP2×PP2×DP2 layout reaches 2.31e-5 at step 5 (1.9e-6 at step 1) — bit for bit
# the same under megatron-core 0.16.1 and torch 2.13's CPU build with that corpus (on Python 3.11's
# corpus it stayed under 2e-5) — bound 3e-5.
TOLERANCE = {"train/lm_loss": 1e-6, "train/grad_norm": 3e-5}

TP1 = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"]
PP1 = ["parallel.pipeline_model_parallel_size=1"]
NO_SP = ["parallel.sequence_parallel=false"]
DISTOPT2, REPLICATED = "distributed optimizer (state sharded over DP×CP=2)", "replicated optimizer state"
LOCAL_SDPA, RING = "attention: torch SDPA", "attention: ring attention over CP"
FSDP = ["parallel.use_megatron_fsdp=true"]
OFFLOADED = get_args(OffloadModule)

LAYOUTS = {
    # name: (processes, overrides on top of configs/tiny.yaml (TP2×PP2+SP), what the run's start-up log must say:
    # the feature was really built — read from megatron-core's objects — not only asked for)
    "tp2": (2, [*PP1, *NO_SP], ["TP2 × CP1 × DP1 × PP1", "kernels: eager, none fused"]),
    # 3 processes for PP2: the third stays idle (an elastic world that the layout does not fit)
    "pp2_1f1b_third_rank_idle": (3, [*TP1, "parallel.allow_idle_ranks=true"], [
        "TP1 × CP1 × DP1 × PP2\n", "PP stage 0 (ranks [0]): layers 1-2 + embedding",
        "PP stage 1 (ranks [1]): layers 3-4 + output layer/loss", "world 3 does not fit (world size (processes "
        "started)=3 is invalid: must be a multiple of ", "2 ranks train (DP 1), rank 2 stays idle and exits"]),
    # with megatron-core's activation offload of every module it offers (under interleaving: below)
    "pp2_1f1b_activation_offload": (
        2, [*TP1, f"train.offload_modules=[{','.join(OFFLOADED)}]", "train.min_offloaded_tensor_size=1024"],
        ["TP1 × CP1 × DP1 × PP2", f"activation offload of {', '.join(OFFLOADED)}",
         "activation offload: 1.4 MiB of saved activations held in host memory at once on this rank (attn_norm 0.4 "
         "MiB, attn_proj 0.1 MiB, core_attn 0.4 MiB, mlp_norm 0.4 MiB, qkv_linear 0.1 MiB)"]),
    "pp2_uneven_1_3_selective_recompute": (2, [*TP1, "parallel.num_layers_in_first_pipeline_stage=1",
                                               "train.recompute_granularity=selective"],
                                           ["PP stage 0 (ranks [0]): layers 1-1", "PP stage 1 (ranks [1]): layers 2-4",
                                            "kernels: selective recompute", "TP1 × CP1 × DP1 × PP2"]),
    "dp2": (2, [*TP1, *PP1, "parallel.use_distributed_optimizer=false"], ["TP1 × CP1 × DP2 × PP1", REPLICATED]),
    "cp4": (4, [*TP1, *PP1, "parallel.context_parallel_size=4"], ["TP1 × CP4 × DP1 × PP1", RING]),
    "dp2_tp2_sp_distopt": (4, PP1, ["TP2 × CP1 × DP2 × PP1", "sequence parallel",
                                    f"{DISTOPT2}; grad sync: after the backward pass"]),
    "tp2_cp2": (4, [*PP1, "parallel.context_parallel_size=2"], ["TP2 × CP2 × DP1 × PP1", RING]),
    "tp2_sp_full_recompute": (2, [*PP1, "train.recompute_granularity=full"],
                              ["TP2 × CP1 × DP1 × PP1", "kernels: sequence parallel, full recompute"]),
    "dp2_distopt_overlap": (2, [*TP1, *PP1, "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"],
                            [DISTOPT2, "grad sync: overlapped grad reduce, overlapped param gather"]),
    "tp2_sp_compiled_fused_swiglu": (2, [*PP1, "train.compile=true", "train.fused_swiglu=true"],
                                     ["kernels: sequence parallel, fused SwiGLU, torch.compile per layer"]),
    # ZeRO-2 (TP2 × DP2 + SP) is proven by tests/integration/test_fsdp_checkpoint.py, where it continues a ZeRO-3 run
    # and, ending on a training step (no evaluation), the all-gathers of the updated parameters that the last
    # optimizer step started are waited for before the process groups close (destroyed under them: a SIGSEGV, seen at
    # random in CI), one per bucket
    "dp4_zero3": (4, [*TP1, *PP1, *FSDP, "train.eval_iters=0"], [
        "TP1 × CP1 × DP4 × PP1", "Megatron-FSDP optim_grads_params (ZeRO-3) over DP×CP=4",
        "Megatron-FSDP: waited for the 5 parameter all-gathers still in flight after the last step before the "
        "process groups close"]),
    # HSDP: ZeRO-3 inside 2 groups of 2 DP×CP ranks, replicated across them (at CP2: Megatron-FSDP shards over
    # DP×CP); or at DP4 with the optimizer state also sharded across the groups, which the grad norm must then be
    # summed over (megatron-core 0.16.1 sums it over one group; training/optimizer.py)
    "dp2_cp2_hsdp2_zero3": (4, [*TP1, *PP1, *FSDP, "parallel.context_parallel_size=2",
                                "parallel.num_distributed_optimizer_instances=2"],
                            ["TP1 × CP2 × DP2 × PP1", RING, "over each of 2 HSDP groups of 2 DP×CP ranks (this rank's: "
                             "[0, 1]), replicated across them"]),
    "dp4_hsdp2_zero3_outer_optim": (4, [*TP1, *PP1, *FSDP, "parallel.num_distributed_optimizer_instances=2",
                                        "parallel.outer_dp_sharding_strategy=optim"],
                                    ["TP1 × CP1 × DP4 × PP1", "over each of 2 HSDP groups of 2 DP×CP ranks (this "
                                     "rank's: [0, 1]), the optimizer state also sharded across them"]),
    "dp2_tp2_sp_zero3": (4, [*PP1, *FSDP], ["TP2 × CP1 × DP2 × PP1", "sequence parallel",
                                          "Megatron-FSDP optim_grads_params (ZeRO-3) over DP×CP=2"]),
    "dp2_tp2_pp2_cp2": (16, ["parallel.context_parallel_size=2"],
                        ["TP2 × CP2 × DP2 × PP2", RING, "distributed optimizer (state sharded over DP×CP=4)"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, initial_weights, single_process_reference, tmp_path):
    nproc, layout, expected = LAYOUTS[name]
    tb = tmp_path / "tb"
    proc = run_pretrain(nproc, [*parity_overrides(initial_weights, tb), *layout], timeout=900)
    log = proc.stdout + proc.stderr
    missing = [fragment for fragment in expected if fragment not in log]
    assert not missing, f"{name}: the start-up log does not show {missing}:\n{log[:4000]}"
    held = re.search(r"this rank holds ([\d,]+) parameter and ([\d,]+) gradient elements of its tensor-parallel "
                     r"part's ([\d,]+)", log)
    if FSDP[0] in layout:  # the sharding, read from Megatron-FSDP's buffers: 1/(DP×CP) (HSDP: 1/group) of its TP part
        # (+ bucket padding)
        params, grads, model = (int(n.replace(",", "")) for n in held.groups())
        # and the planner's estimate of it (fp32: 4 bytes an element) within 10 %
        cfg = load_config(TINY, [*parity_overrides(None, tb), *layout])
        planned = rank_static_bytes(cfg, nproc, 0, 0, model_vocab_size(cfg))
        assert abs(planned["params"] / 4 - params) <= 0.1 * params, (planned, held[0])
        assert abs(planned["grads"] / 4 - grads) <= 0.1 * grads, (planned, held[0])
        p = cfg.parallel  # sharded within one HSDP group (all of DP×CP without HSDP)
        group = data_parallel_size(cfg, nproc) * p.context_parallel_size // p.num_distributed_optimizer_instances
        shard = model / group
        assert shard <= grads <= 1.01 * shard, held[0]
        sharded_params = "parallel.data_parallel_sharding_strategy=optim_grads" not in layout  # ZeRO-3
        assert (shard if sharded_params else model) <= params <= 1.01 * (shard if sharded_params else model)
    for tag, tolerance in TOLERANCE.items():
        reference = read_scalars(single_process_reference, tag)
        measured = read_scalars(tb, tag)
        assert len(measured) == PARITY_STEPS
        diff = max_relative_difference(measured, reference)
        print(f"parity {name} {tag}: max rel diff {diff:.2e}")
        assert diff <= tolerance, (name, tag, measured, reference)


def test_activation_offload_under_interleaving_changes_nothing(tmp_path):
    """PP2 × VPP2 over 8 layers (2 per virtual stage: one is refused, see config.validate) with megatron-core's
    activation offload of every module it offers: each step's loss and grad norm are those of the same run without
    offload within the parity bounds (its chunk handlers follow the interleaved order, steps after the first
    included). Not bit for bit: measured 1.2e-7 (loss) and 7.4e-6 (grad norm) on megatron-core 0.19.2."""
    interleaved = [*TP1, "parallel.virtual_pipeline_model_parallel_size=2", "model.num_layers=8"]
    offloaded = [f"train.offload_modules=[{','.join(OFFLOADED)}]", "train.min_offloaded_tensor_size=1024"]
    for name, extra in (("plain", []), ("offloaded", offloaded)):
        proc = run_pretrain(2, [*parity_overrides(None, tmp_path / name), *interleaved, *extra])
    assert ("activation offload: 6.9 MiB of saved activations held in host memory at once on this rank (attn_norm 1.9 "
            "MiB, attn_proj 0.6 MiB, core_attn 1.9 MiB, mlp_norm 1.9 MiB, qkv_linear 0.6 MiB)") in proc.stdout, \
        proc.stdout[-3000:]
    for tag, tolerance in TOLERANCE.items():
        plain, offloaded = read_scalars(tmp_path / "plain", tag), read_scalars(tmp_path / "offloaded", tag)
        diff = max_relative_difference(offloaded, plain)
        print(f"interleaved activation offload {tag}: max rel diff {diff:.2e}")
        assert len(plain) == PARITY_STEPS and diff <= tolerance, (tag, offloaded, plain)

