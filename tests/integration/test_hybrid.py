"""megatron-core's HybridModel (model.model_class=hybrid) trains what GPTModel trains, and takes over GPTModel's
checkpoints (CPU, gloo, fp32).

* From the parity matrix's initial weights (a GPTModel checkpoint), hybrid runs under parallel layouts reproduce the
  single-process GPTModel run within the parity matrix's bounds.
* A GPTModel run's training checkpoint resumes as a hybrid run that continues the uninterrupted GPTModel run's curve
  bit for bit (test_legacy_checkpoints.py resumes the previous stack's four checkpoints as hybrid runs too, resharded
  among them), and ``export-hf`` reads the hybrid run's checkpoint.
"""

from __future__ import annotations

import pytest

from tests.conftest import PARITY_STEPS, parity_overrides
from tests.integration.test_parallel_parity import TOLERANCE
from tests.launch import max_relative_difference, read_scalars, run_module, run_pretrain

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
MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_layer_freq=[1,1,1,1]"]


def test_gptmodel_checkpoint_resumes_as_hybrid_bit_for_bit_and_exports(tmp_path):
    """An MoE GPTModel run's checkpoint in the dp_reshardable format (megatron-core's flat buffers, no parameter keys;
    its moe_layer_freq a list: a checkpoint that names each layer, the format megatron-core's own translation does
    not read) resumes as a hybrid run under the same TP2×PP2 layout that continues the uninterrupted run bit for bit;
    ``export-hf`` reads the hybrid checkpoint that run writes as it reads GPTModel's: the same Hugging Face tensors."""
    from safetensors.torch import load_file

    def run(extra: list[str], tb: str) -> str:
        return run_pretrain(4, [*parity_overrides(None, tmp_path / tb), *MOE, *extra]).stdout

    run([f"train.exit_interval={STOP}", f"checkpoint.save={tmp_path / 'gpt'}"], "gpt")
    run([f"checkpoint.load={tmp_path / 'gpt'}", f"checkpoint.save={tmp_path / 'gpt_end'}"], "gpt")
    log = run([HYBRID, f"checkpoint.load={tmp_path / 'gpt'}", f"checkpoint.save={tmp_path / 'hybrid'}"], "hybrid")
    assert "model.model_class: 'gpt' → 'hybrid'" in log, log[-3000:]
    for tag in TOLERANCE:
        uninterrupted, resumed = read_scalars(tmp_path / "gpt", tag), read_scalars(tmp_path / "hybrid", tag)
        assert resumed == {step: uninterrupted[step] for step in range(STOP + 1, PARITY_STEPS + 1)}, tag
    exported = {}
    for name in ("gpt_end", "hybrid"):
        run_module(1, ["-m", "recipes.convert", "export-hf", "--checkpoint", str(tmp_path / name),
                       "--output", str(tmp_path / f"{name}_hf")])
        exported[name] = load_file(tmp_path / f"{name}_hf" / "model.safetensors")
    assert exported["gpt_end"].keys() == exported["hybrid"].keys()
    assert all(exported["hybrid"][k].equal(tensor) for k, tensor in exported["gpt_end"].items())
