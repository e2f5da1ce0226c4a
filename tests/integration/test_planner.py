"""The planner's memory model against megatron-core on CPU: ``tests/workers/planner_memory_worker.py`` runs under
torchrun for a layout, builds the tiny model with the recipe's own functions, trains one step and reports
per-rank parameter / grad-buffer / optimizer bytes (compared for equality) and the bytes saved for backward by
one micro batch (compared within 10 %)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext import planner
from tests.launch import ROOT, launch_prefix

BF16, FP32 = "train.precision=bf16", "train.precision=fp32"
TP1 = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"]
PP1 = ["parallel.pipeline_model_parallel_size=1"]
TIED = "model.untie_embeddings_and_output_weights=false"

# name: (processes, overrides on configs/tiny.yaml (TP2×PP2+SP, distopt) + SMALL_MODEL, measure activations)
WORKER_LAYOUTS = {
    "dp2_plain_optimizer_fp32": (2, [*TP1, *PP1, FP32, "parallel.use_distributed_optimizer=false"], True),
    "single_bf16_full_recompute_tied": (1, [*TP1, *PP1, BF16, TIED, "train.recompute_granularity=full"],
                                        True),
    "tp2_sp_bf16_selective": (2, [*PP1, BF16, "train.recompute_granularity=selective"], True),
    "dp2_pp2_vpp2_distopt_overlap_fp32": (4, [*TP1, FP32, "parallel.virtual_pipeline_model_parallel_size=2",
                                               "parallel.overlap_grad_reduce=true"], False),
    "tp2_pp2_sp_distopt_bf16_tied": (4, [BF16, TIED], False),
    "cp2_dp2_distopt_bf16": (4, [*TP1, *PP1, BF16, "parallel.context_parallel_size=2"], False),
    # MoE (Qwen3-style q/k norms, shared experts; a first dense layer and an MTP layer as DeepSeek-V3's): the experts'
    # buffers sharded over expert-DP2, the rest over DP4
    "dp4_ep2_moe_shared_qk_norm_first_dense_mtp_bf16": (
        4, [*TP1, *PP1, BF16, "model.num_moe_experts=4", "model.moe_ffn_hidden_size=96",
            "model.moe_shared_expert_intermediate_size=64", "model.qk_layernorm=true", "model.moe_layer_freq=[0,1,1,1]",
            "model.mtp_num_layers=1", "parallel.expert_model_parallel_size=2"], True),
    # multi-latent attention under TP2 + SP (YaRN): heads wider than hidden / heads, as DeepSeek-V3's 192 + 128 vs 56
    "tp2_sp_mla_yarn_bf16": (2, [*PP1, BF16, "model.multi_latent_attention=true", "model.num_query_groups=null",
                                 "model.q_lora_rank=64", "model.kv_lora_rank=48", "model.qk_head_dim=48",
                                 "model.qk_pos_emb_head_dim=16", "model.v_head_dim=32", "model.rope_type=yarn",
                                 "model.original_max_position_embeddings=64"], True),
}


def _run_worker(nproc: int, overrides: list[str], out: Path, activations: bool) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    module = ["-m", "tests.workers.planner_memory_worker", "--out", str(out)]
    module += ["--activations"] if activations else []
    cmd = [sys.executable, *launch_prefix(nproc), *module, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("name", list(WORKER_LAYOUTS))
def test_planner_matches_megatron_core_memory(name, tmp_path):
    from tests.workers.planner_memory_worker import VOCAB, worker_config

    nproc, overrides, activations = WORKER_LAYOUTS[name]
    cfg = worker_config(overrides)
    ranks = _run_worker(nproc, overrides, tmp_path, activations)
    for r in ranks:
        expected = planner.rank_static_bytes(cfg, nproc, r["pp_rank"], r["dp_cp_rank"], VOCAB, r["expert_dp_rank"])
        measured = {k: r[k] for k in expected}
        print(f"{name} rank {r['rank']} (pp {r['pp_rank']}, dp×cp {r['dp_cp_rank']}): measured {measured}, "
              f"planner {expected}")
        assert measured == expected, (name, r["rank"])
        if activations:
            # CPU rule: torch's composite RMSNorm (fp32 copies); flash SDPA on both sides
            estimate = planner.chunk_activation_bytes(cfg, VOCAB, range(cfg.model.num_layers), True, True,
                                                      fused_norm=False)
            got = r["activations"]["bytes"]
            if cfg.model.multi_latent_attention:  # CPU SDPA's math path for MLA (fp32 copies, scores): not compared
                got -= sum(nbytes for where, *_, nbytes in r["activations"]["tensors"] if "core_attention" in where)
                tokens = cfg.train.micro_batch_size * cfg.model.seq_length
                estimate -= cfg.model.num_layers * planner.mla_core_attention_bytes(
                    planner.RankShape.of(cfg, VOCAB), tokens)
            print(f"{name} rank {r['rank']} activations: measured {got}, planner {estimate} "
                  f"({100 * (estimate - got) / got:+.2f} %)")
            assert abs(estimate - got) <= 0.10 * got, (name, got, estimate)




