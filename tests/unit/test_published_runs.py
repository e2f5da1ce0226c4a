"""The planner held against the published record (docs/published-runs.csv), its GPU table, the kernel-by-kernel time
terms of TransformerEngine's layers, and strong/weak scaling."""

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_ext.config.schema import load_config
from megatron_ext.hardware import GPUS
from megatron_ext.planner import estimate, model_vocab_size
from megatron_ext.planner.compute_time import te_compute_seconds
from megatron_ext.planner.layout import RankShape
from megatron_ext.planner.published import (
    COLUMNS,
    FEATURE_KEYS,
    PRECISION_KEYS,
    SHARDING_KEYS,
    read_published,
    replan,
    summary,
)
from megatron_ext.planner.scaling import scaling
from recipes import plan as plan_cli

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "docs" / "published-runs.csv"
CONFIGS = ROOT / "configs"


@pytest.fixture(scope="module")
def replanned():
    return [replan(run, CONFIGS) for run in read_published(PUBLISHED)]


def test_every_row_of_a_family_the_project_has_is_planned(replanned):
    """Only rows without a recipe family or without a published throughput go unplanned, each with its one line."""
    unplanned = {r.run.idx: r.reason for r in replanned if r.error is None}
    assert all(reason and "\n" not in reason for reason in unplanned.values())
    families = {r.run["model"] for r in replanned if r.run.idx in unplanned and r.run["config"]}
    assert families == {"DeepSeek-V3"} and "no published throughput" in unplanned[56]
    assert all(not r.run["config"] for r in replanned if r.run.idx in unplanned and r.run.idx != 56)


def test_the_planner_is_held_to_its_measured_accuracy_on_the_published_runs(replanned):
    """The accuracy docs/planner.md reports (median |error| 10.2 %, 64 % of rows within 20 %: short of the issue's
    10 % and 80 %, said there) cannot regress, and no other BF16 row than GPT-OSS's on GB200 is planned above a
    published FP8 run of its layout."""
    s = summary(replanned)
    assert s["planned"] == 45
    assert s["median_abs_error"] <= 0.105
    assert s["within_20_percent"] >= 0.64
    # GPT-OSS-120B on GB200 at EP64 (#27 BF16 above #28 MXFP8): the planner's worst pair, said in docs/planner.md
    assert s["bf16_planned_above_published_fp8"] == [(27, 28)]


def test_fp8_rows_plan_faster_than_the_same_layout_in_bf16():
    """The precision term: an FP8 recipe speeds the GEMMs up, not attention; quantization costs HBM time."""
    cfg = load_config(CONFIGS / "llama3_8b_8gpu_bf16.yaml", ["model.attention_backend=te", "train.precision=bf16"])
    gpu, vocab = GPUS["h100-80gb"], model_vocab_size(cfg)
    bf16 = estimate(cfg, 8, 8, gpu, vocab)
    fp8 = estimate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8="tensorwise")), 8, 8, gpu, vocab)
    assert 1.2 < fp8.tokens_per_s_per_gpu / bf16.tokens_per_s_per_gpu < 2.0
    shape = RankShape.of(cfg, vocab)
    kernels = te_compute_seconds(cfg, shape, range(4), False, gpu, 4096)
    fp8_kernels = te_compute_seconds(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8="tensorwise")),
                                     shape, range(4), False, gpu, 4096)
    assert fp8_kernels["gemm"] == pytest.approx(kernels["gemm"] * 989 / 1979) and fp8_kernels["attention"] == kernels["attention"]
    assert kernels["quantize"] == 0 < fp8_kernels["quantize"]


@pytest.mark.parametrize("switch, part", [("parallel.tp_comm_overlap=true", "tp_comm"),
                                          ("parallel.overlap_moe_expert_parallel_comm=true", "moe_comm")])
def test_each_overlap_hides_its_communication(switch, part):
    base = ["model.attention_backend=te", "train.precision=bf16", "parallel.tensor_model_parallel_size=2",
            "parallel.sequence_parallel=true", "parallel.expert_model_parallel_size=8",
            "parallel.pipeline_model_parallel_size=1", "parallel.virtual_pipeline_model_parallel_size=null"]
    cfg = load_config(CONFIGS / "qwen3_30b_a3b_16gpu_bf16.yaml", base)
    gpu, vocab = GPUS["h100-80gb"], model_vocab_size(cfg)
    without = estimate(cfg, 16, 8, gpu, vocab)
    with_overlap = estimate(load_config(CONFIGS / "qwen3_30b_a3b_16gpu_bf16.yaml", [*base, switch]), 16, 8, gpu, vocab)
    assert with_overlap.time[part] < without.time[part] and with_overlap.time["step"] < without.time["step"]


def test_cuda_graphs_remove_launches_and_a_full_iteration_graph_the_dropless_sync():
    cfg = load_config(CONFIGS / "qwen3_30b_a3b_16gpu_bf16.yaml", ["model.attention_backend=te"])
    shape, gpu = RankShape.of(cfg, model_vocab_size(cfg)), GPUS["b200"]
    launch = {impl: te_compute_seconds(load_config(CONFIGS / "qwen3_30b_a3b_16gpu_bf16.yaml", [
        "model.attention_backend=te", f"train.cuda_graph_impl={impl}"]), shape, range(4), False, gpu, 4096)["launch"]
              for impl in ("none", "transformer_engine", "full_iteration")}
    assert launch["none"] > launch["transformer_engine"] > launch["full_iteration"] == 0


def test_an_nvl72_rack_keeps_expert_parallelism_on_nvlink():
    """EP64 dispatches over NVLink inside an NVL72 rack, over the network on 8-GPU nodes."""
    overrides = ["model.attention_backend=te", "parallel.expert_model_parallel_size=64",
                 "parallel.pipeline_model_parallel_size=1", "parallel.virtual_pipeline_model_parallel_size=null"]
    cfg = load_config(CONFIGS / "qwen3_30b_a3b_16gpu_bf16.yaml", overrides)
    vocab = model_vocab_size(cfg)
    rack = estimate(cfg, 64, 4, GPUS["gb200"], vocab)
    nodes = estimate(cfg, 64, 8, dataclasses.replace(GPUS["gb200"], nvlink_domain=8), vocab)
    assert rack.time["moe_comm"] < nodes.time["moe_comm"] / 5


def test_the_gpu_table_has_the_2026_gpus_with_consistent_peaks():
    assert {"b200", "gb200", "b300", "gb300", "h100-80gb", "h200-141gb", "a100-80gb"} <= set(GPUS)
    for spec in GPUS.values():
        assert spec.peak_fp4_tflops == 0 or spec.peak_fp4_tflops > spec.peak_fp8_tflops > spec.peak_bf16_tflops
        assert (spec.peak_fp8_tflops > 0) == (spec.compute_capability >= (8, 9))
        assert spec.nvlink_domain % spec.node_gpus == 0 and spec.nvlink_domain in (8, 72)
    assert GPUS["gb200"].nvlink_domain == GPUS["gb300"].nvlink_domain == 72


def test_every_published_column_value_maps_to_recipe_keys_the_schema_has():
    cfg = CONFIGS / "tiny_moe.yaml"
    for table in (PRECISION_KEYS, SHARDING_KEYS, FEATURE_KEYS):
        for keys in table.values():
            load_config(cfg, list(keys or []))


def test_the_published_command_prints_rows_and_json_and_refuses_another_header(tmp_path, capsys):
    assert plan_cli.main(["--published", str(PUBLISHED), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {row["idx"]: row for row in out["rows"]}
    assert {"planned_tokens_per_s_per_gpu", "published_tokens_per_s_per_gpu", "error"} <= set(rows[0])
    assert "reason" in rows[13] and out["summary"]["planned"] == 45
    bad = tmp_path / "runs.csv"
    bad.write_text("idx,model\n0,x\n")
    assert plan_cli.main(["--published", str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert COLUMNS[0] == "idx"


def test_scaling_reports_speedup_efficiency_and_its_cost(tmp_path, capsys):
    cfg = load_config(CONFIGS / "llama3_8b_8gpu_bf16.yaml")
    strong = scaling(cfg, [16, 8, 32], 8, "h100-80gb", "strong")
    assert [p.gpus for p in strong] == [8, 16, 32] and strong[0].speedup == 1 and strong[0].cause is None
    assert all(p.global_batch_size == cfg.train.global_batch_size for p in strong)
    assert all(0.5 < p.efficiency <= 1.0 + 1e-9 and p.cause for p in strong[1:])
    weak = scaling(cfg, [8, 32], 8, "h100-80gb", "weak")
    assert weak[1].global_batch_size == 4 * cfg.train.global_batch_size and weak[1].efficiency >= strong[2].efficiency
    png = tmp_path / "scaling.png"
    assert plan_cli.main(["--config", str(CONFIGS / "llama3_8b_8gpu_bf16.yaml"), "--scaling", "8,16",
                          "--plot", str(png)]) == 0
    assert "strong scaling" in capsys.readouterr().out and png.stat().st_size > 0
