"""megatron-core's HybridModel (model.model_class=hybrid) trains what GPTModel trains, and takes over GPTModel's
checkpoints (CPU, gloo, fp32).

* From the parity matrix's initial weights (a GPTModel checkpoint), hybrid runs under parallel layouts reproduce the
  single-process GPTModel run within the parity matrix's bounds.
* A GPTModel run's training checkpoint resumes as a hybrid run that continues the uninterrupted GPTModel run's curve:
  under the layout it was saved in, from dp_reshardable optimizer state (bit for bit), and resharded to another
  layout from fully reshardable optimizer state (an MoE model, whose checkpoint names each layer: the other format).
"""

from __future__ import annotations

import pytest

from tests.conftest import PARITY_STEPS, parity_overrides
from tests.integration.test_parallel_parity import TOLERANCE
from tests.launch import max_relative_difference, read_scalars, run_pretrain

HYBRID = "model.model_class=hybrid"
TP1 = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"]

LAYOUTS = {
    # name: (processes, overrides on top of configs/tiny.yaml (TP2×PP2+SP), what the start-up log must say)
    "tp2_sp_pp2": (4, [], ["TP2 × CP1 × DP1 × PP2", "PP stage 0 (ranks [0, 1]): layers 1-2 + embedding",
                           "PP stage 1 (ranks [2, 3]): layers 3-4 + output layer/loss", "kernels: sequence parallel"]),
    "dp2_cp2_zero3": (4, [*TP1, "parallel.pipeline_model_parallel_size=1", "parallel.context_parallel_size=2",
                          "parallel.use_megatron_fsdp=true", "train.eval_iters=0"],
                      ["TP1 × CP2 × DP2 × PP1", "attention: ring attention over CP",
                       "Megatron-FSDP optim_grads_params (ZeRO-3) over DP×CP=4"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_layout_matches_gptmodel_single_process(name, initial_weights, single_process_reference, tmp_path):
    nproc, layout, expected = LAYOUTS[name]
    proc = run_pretrain(nproc, [*parity_overrides(initial_weights, tmp_path), HYBRID, *layout])
    missing = [fragment for fragment in expected if fragment not in proc.stdout]
    assert not missing, f"{name}: the start-up log does not show {missing}:\n{proc.stdout[:4000]}"
    for tag, tolerance in TOLERANCE.items():
        measured, reference = read_scalars(tmp_path, tag), read_scalars(single_process_reference, tag)
        diff = max_relative_difference(measured, reference)
        print(f"hybrid {name} {tag}: max rel diff {diff:.2e}")
        assert len(measured) == PARITY_STEPS and diff <= tolerance, (name, tag, measured, reference)


STOP = 3
MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_layer_freq=[0,1,1,1]"]


@pytest.mark.parametrize("model, saved_as, resumed_as, tolerance", [
    ([], [], [], {"train/lm_loss": 0.0, "train/grad_norm": 0.0}),
    ([*MOE, "checkpoint.optimizer_format=fully_reshardable"], [],
     [*TP1, "parallel.expert_model_parallel_size=2"], TOLERANCE),
], ids=["same_layout_dp_reshardable", "moe_tp2pp2_to_dp2ep2pp2_fully_reshardable"])
def test_gptmodel_checkpoint_resumes_as_hybrid(model, saved_as, resumed_as, tolerance, tmp_path):
    def run(extra: list[str], tb: str) -> str:
        return run_pretrain(4, [*parity_overrides(None, tmp_path / tb), *model, *extra]).stdout

    run([*saved_as, f"train.exit_interval={STOP}", f"checkpoint.save={tmp_path / 'gpt'}"], "gpt")
    run([*saved_as, f"checkpoint.load={tmp_path / 'gpt'}"], "gpt")
    log = run([*resumed_as, HYBRID, f"checkpoint.load={tmp_path / 'gpt'}",
               f"checkpoint.save={tmp_path / 'hybrid'}"], "hybrid")
    assert "model.model_class: 'gpt' → 'hybrid'" in log, log[-3000:]
    for tag, bound in tolerance.items():
        uninterrupted, resumed = read_scalars(tmp_path / "gpt", tag), read_scalars(tmp_path / "hybrid", tag)
        assert sorted(resumed) == list(range(STOP + 1, PARITY_STEPS + 1)), resumed
        diff = max_relative_difference(resumed, {step: uninterrupted[step] for step in resumed})
        print(f"GPTModel checkpoint resumed as hybrid {tag}: max rel diff {diff:.2e}")
        assert diff <= bound, (tag, resumed, uninterrupted)
