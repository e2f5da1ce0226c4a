"""The layout planner's arithmetic and its choices: DDP buckets, schedules, candidates the recipe accepts,
published layouts of Llama 3 8B/70B, and the 1B recipe's measured H100 speed."""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest

from megatron_ext import planner
from megatron_ext.config.schema import ddp_bucket_size, load_config
from megatron_ext.config.shape import model_flops_per_token
from megatron_ext.config.validate import validate_layout
from megatron_ext.hardware import GPUS
from megatron_ext.planner import GIB, Layout, best_layout, explain, plan
from megatron_ext.planner.static_memory import _ddp_buckets, _owned_elements
from megatron_ext.planner.step_time import te_layers
from tests.launch import ROOT, TINY

LLAMA3_8B = ROOT / "configs" / "llama3_8b_8gpu_bf16.yaml"
LLAMA3_70B = ROOT / "configs" / "llama3_70b_64gpu_bf16.yaml"


def _key(e: planner.Estimate) -> tuple:
    L = e.layout
    return L.tp, L.pp, L.vpp, L.cp


# ---------------------------------------------------------------------------------------------
# Pure computation


def test_ddp_bucket_padding_and_shared_embedding_bucket():
    # reverse order: 100 → [0,100); 3 → 64-aligned [128,131); shared 50 gets its own bucket
    params = [(50, True), (3, False), (100, False)]
    buckets = _ddp_buckets(params, dp_cp=3, distopt=True, bucket_size=None)
    assert [(s, e) for s, e, _ in buckets] == [(0, 384), (384, 768)]  # ends padded to lcm(3, 128)
    assert buckets[0][2] == [(0, 100), (128, 131)] and buckets[1][2] == [(384, 434)]
    assert _owned_elements(buckets, 3) == [100 + 50, 3, 0]  # each bucket sliced in 3 x 128
    plain = _ddp_buckets(params, dp_cp=3, distopt=False, bucket_size=None)
    assert [(s, e) for s, e, _ in plain] == [(0, 153)]  # no padding, no split without distopt


def test_bucket_size_is_megatron_cores_with_overlap_only():
    cfg = load_config(LLAMA3_8B)
    assert cfg.parallel.overlap_grad_reduce and ddp_bucket_size(cfg, 8) == 40_000_000
    assert ddp_bucket_size(cfg, 64) == 64_000_000  # max(4e7, 1e6 × DP)
    assert ddp_bucket_size(load_config(LLAMA3_8B, ["parallel.ddp_bucket_size=1000"]), 64) == 1000
    assert ddp_bucket_size(load_config(LLAMA3_8B, ["parallel.overlap_grad_reduce=false"]), 8) is None


def test_microbatches_in_flight_match_megatron_schedule():
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    for pp, vpp, m in [(2, 2, 4), (4, 2, 8), (8, 5, 64), (4, 5, 4), (4, 3, 12)]:
        for rank in range(pp):
            comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                                   virtual_pipeline_model_parallel_size=vpp)
            total, _, warmup, remaining = get_pp_rank_microbatches(m, vpp, pp, p2p_communicator=comm)
            expected = warmup + (1 if remaining else 0)
            assert planner.microbatches_in_flight(pp, vpp, m, rank) == expected, (pp, vpp, m, rank)
    assert planner.microbatches_in_flight(4, None, 8, 0) == 4  # 1F1B: PP − rank
    assert planner.microbatches_in_flight(4, None, 2, 0) == 2  # fewer micro batches than stages


def test_every_candidate_is_accepted_by_the_recipe_and_keeps_tp_in_a_node():
    cfg = load_config(LLAMA3_8B)
    layouts = list(planner.candidate_layouts(cfg, 16, 8))
    assert layouts and all(L.tp <= 8 and L.tp * L.pp * L.cp * L.dp == 16 for L in layouts)
    for L in layouts[:: max(1, len(layouts) // 50)]:
        validate_layout(L.apply(cfg), 16, te_available=True, compute_capability=(9, 0))
    # validate_layout's rules hold for all of them, e.g. interleaving needs micro batches % PP == 0
    assert not any(L.vpp and (128 // (L.mbs * L.dp)) % L.pp for L in layouts)
    assert any(L.vpp for L in layouts) and any(L.cp > 1 for L in layouts)
    # CP up to chunks of MIN_CP_CHUNK_TOKENS: 8,192 tokens in 2·8 chunks of 512, not CP 16's 256
    assert max(L.cp for L in layouts) == 8 and planner.search.MIN_CP_CHUNK_TOKENS == 512


def test_best_layout_gives_config_values_the_recipe_accepts():
    cfg = load_config(LLAMA3_8B)
    best = best_layout(cfg, 8, 8, "h100-80gb")
    assert set(best) == {"parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                         "parallel.virtual_pipeline_model_parallel_size", "parallel.context_parallel_size",
                         "parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage",
                         "parallel.sequence_parallel", "parallel.use_distributed_optimizer",
                         "parallel.use_megatron_fsdp", "parallel.num_distributed_optimizer_instances",
                         "optimizer.optimizer_cpu_offload", "parallel.expert_model_parallel_size",
                         "parallel.expert_tensor_parallel_size",
                         "parallel.outer_dp_sharding_strategy", "train.micro_batch_size", "train.recompute_granularity"}
    overrides = [f"{k}={'null' if v is None else str(v).lower()}" for k, v in best.items()]
    validate_layout(load_config(LLAMA3_8B, overrides), 8, te_available=True)


def test_too_small_a_cluster_is_reported():
    cfg = load_config(LLAMA3_70B)
    with pytest.raises(Exception, match="no valid layout"):
        best_layout(cfg, 8, 8, "a100-40gb")


def test_cli_json(capsys):
    from recipes.plan import main

    assert main(["--config", str(LLAMA3_8B), "--gpus", "8", "--gpu", "h200-141gb", "--top", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["layouts"]) == 3 and out["fitting_layouts"] <= out["valid_layouts"]
    first = out["layouts"][0]
    assert first["fits"] and first["memory_gib"]["total"] <= GPUS["h200-141gb"].memory_gib
    assert set(first["time_s"]) >= {"compute", "tp_comm", "cp_comm", "pp_bubble", "dp_comm", "step"}


def test_cli_table_explains_the_best(capsys):
    from recipes.plan import main

    assert main(["--config", str(LLAMA3_8B), "--gpus", "8", "--top", "5", "--seq-length", "4096"]) == 0
    out = capsys.readouterr().out
    assert "fastest layouts that fit" in out and "1. TP" in out and "to use the best:" in out
    assert "ZeRO-" not in out.split("fastest layouts that fit")[1].split("1. TP")[0]  # ZeRO-1 fits: no FSDP
    assert main(["--config", str(LLAMA3_8B), "--gpus", "8", "--top", "1", "parallel.use_megatron_fsdp=true",
                 "parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"]) == 0
    out = capsys.readouterr().out
    assert "the config's own layout TP1 PP1 CP4 DP2 distopt ZeRO-3 mbs1" in out and "(fits; rank" in out


def test_the_configs_own_layout_without_an_estimate_says_why_and_the_nearest_split(capsys):
    """Six layers over PP4 with a first stage of 2 leave 4 that do not divide over the other 3 stages: the validation's
    line in the table's place and in --json (config_layout_error), with the planner's near-even split that validates."""
    from recipes.plan import main

    argv = ["--config", str(TINY), "--gpus", "4", "--top", "1", "model.num_layers=6",
            "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false", "parallel.pipeline_model_parallel_size=4",
            "parallel.num_layers_in_first_pipeline_stage=2"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    nearest = ("(the nearest split that validates at PP4: parallel.num_layers_in_first_pipeline_stage=2 "
               "parallel.num_layers_in_last_pipeline_stage=2 parallel.virtual_pipeline_model_parallel_size=null)")
    assert "the config's own layout has no estimate: model.num_layers=6 is invalid" in said and nearest in said, said
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config_layout"] is None and out["config_layout_error"].endswith(nearest)


def test_llama3_8b_on_8_h100_matches_published_layouts():
    """Megatron-Bridge's H100 BF16 preset: TP1 PP1 CP2 (DP4), mbs 1, with bf16 grad reduction."""
    cfg = load_config(LLAMA3_8B)
    top = plan(cfg, 8, 8, "h100-80gb")[:5]
    assert all(e.fits and e.layout.pp <= 2 and e.layout.tp in (1, 2) and e.layout.cp <= 4 for e in top)
    assert any(e.layout.cp <= 2 for e in top)
    # The recipe reduces grads in fp32 (+15 GiB on 8B): the published CP2 needs bf16 grads to fit.
    ranked = plan(cfg, 8, 8, "h100-80gb", grad_reduce_in_fp32=False)
    published = [e for e in ranked if _key(e) == (1, 1, None, 2) and e.layout.mbs == 1]
    assert published and published[0].fits
    assert _key(ranked[0]) == (1, 1, None, 2)


def test_llama3_70b_on_64_h100_is_near_published_layouts():
    """Megatron-Bridge's H100 presets: BF16 TP4 PP4 VPP5 CP2, FP8 TP4 PP8 VPP5 (GBS 128/256, bf16 grads)."""
    cfg = load_config(LLAMA3_70B)
    ranked = plan(cfg, 64, 8, "h100-80gb")
    top = ranked[:5]
    assert all(e.fits and e.layout.tp in (2, 4, 8) and e.layout.pp in (2, 4, 8) for e in top)
    # the published TP4 PP4 CP2 (without VPP: with fp32 grads VPP5 does not fit) within 1 % of the best
    published = next(e for e in ranked if _key(e) == (4, 4, None, 2) and e.layout.sp
                     and e.layout.mbs == 1 and e.layout.recompute is None and e.layout.distopt)
    assert published.fits and published.time["step"] <= 1.01 * top[0].time["step"]
    mb_cfg = load_config(LLAMA3_70B, ["train.global_batch_size=256"])
    ranked = plan(mb_cfg, 64, 8, "h100-80gb", grad_reduce_in_fp32=False)
    published = next(e for e in ranked if _key(e) == (4, 4, 5, 2) and e.layout.sp and e.layout.distopt
                     and e.layout.mbs == 1 and e.layout.recompute is None)
    assert published.fits and published.time["step"] <= 1.02 * ranked[0].time["step"]
    # FP8's TP4 PP8 VPP5 holds 94 layers' activations on stage 0: in BF16 it does not fit.
    fp8 = next(e for e in ranked if _key(e) == (4, 8, 5, 1) and e.layout.sp and e.layout.recompute is None
               and e.layout.mbs == 1 and e.layout.distopt)
    assert not fp8.fits and fp8.memory["activations"] > 60 * GIB


def test_memory_shrinks_the_way_each_switch_promises():
    cfg = load_config(LLAMA3_8B)
    vocab = planner.model_vocab_size(cfg)
    gpu = GPUS["h100-80gb"]

    def mem(**kw) -> dict[str, float]:
        base = dict(tp=2, pp=1, vpp=None, cp=1, dp=4, sp=False, distopt=False, recompute=None, mbs=1)
        return planner.estimate(Layout(**{**base, **kw}).apply(cfg), 8, 8, gpu, vocab).memory

    assert mem(distopt=True)["optimizer"] == pytest.approx(mem()["optimizer"] / 4, rel=1e-3)
    assert mem(sp=True)["activations"] < mem()["activations"]
    full, selective, none = (mem(recompute=r)["activations"] for r in ("full", "selective", None))
    assert full < selective < none
    assert mem(mbs=2)["activations"] == pytest.approx(2 * mem()["activations"], rel=0.02)


def test_compile_auto_is_planned_as_the_recipe_resolves_it():
    """auto compiles local layers on a GPU, but not TE layers and not under CUDA graphs (resolve_kernel_options); a
    GPU cluster's NGC container resolves attention_backend=auto to TE, and the planner plans it so."""
    recipe = ROOT / "configs" / "llama3_2_1b_1gpu_bf16.yaml"
    local = ["model.attention_backend=local"]
    efficiency = {tuple(o): planner.kernel_efficiency(load_config(recipe, list(o))) for o in
                  [local, ("model.attention_backend=te",), (*local, "train.cuda_graph_impl=local"),
                   (*local, "train.compile=false")]}
    assert list(efficiency.values()) == [planner.KERNEL_EFFICIENCY[k] for k in ("compiled", "eager", "eager", "eager")]
    assert te_layers(load_config(recipe)) and not te_layers(load_config(recipe, local))


def test_fused_linear_cross_entropy_frees_the_logits_by_hand_count():
    """1B recipe, mbs 4 × seq 4096 = 16384 tokens, vocab 128256, hidden 2048, bf16. Unfused: fp32 softmax kept
    (16384·128256·4) + bf16 logits working set (·2) = 12,608,077,824 B. liger: its gradients kept, input
    16384·2048·2 + weight 128256·2048·2, working set one chunk of next_pow2(ceil(16384 / ceil(128256/2048)=63))
    = 512 tokens of logits (512·128256·2) + the fp32 weight-gradient accumulator (128256·2048·4):
    1,774,452,736 B."""
    recipe = ROOT / "configs" / "llama3_2_1b_1gpu_bf16.yaml"
    unfused, fused = (planner.estimate(load_config(recipe, [f"train.fused_linear_cross_entropy={on}"]), 1, 8,
                                       GPUS["h100-80gb"], 128256).memory for on in ("false", "true"))
    assert unfused["total"] - fused["total"] == 12_608_077_824 - 1_774_452_736
    assert unfused["buffers"] - fused["buffers"] == 16384 * 128256 * 2 - (512 * 128256 * 2 + 128256 * 2048 * 4)


def test_activation_offload_frees_the_attention_inputs_by_hand_count():
    """8B shape (hidden 4096, 32 heads, 8 KV groups, head dim 128) in bf16 at TP1 × PP1, mbs 1 × seq 8192. Per
    token, what megatron-core's offload of every module moves: each norm its input + fp32 rstd (2·4096 + 4, twice),
    qkv_linear its input (2·4096), core_attn RoPE'd q and k and the fused QKV output v keeps alive
    (2·(2·4096 + 3·1024)) + the fp32 log-sum-exp (4·32), attn_proj its input (2·4096) = 55,432 B. All 32 layers of
    the one micro batch in flight but two leave the device."""
    layout = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
              "parallel.sequence_parallel=false", "parallel.context_parallel_size=1", "train.micro_batch_size=1",
              "model.seq_length=8192"]
    every = "train.offload_modules=[attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm]"
    kept, offloaded = (load_config(LLAMA3_8B, [*layout, *extra]) for extra in ([], [every]))
    per_layer = 8192 * 55_432
    assert planner.offloaded_layer_bytes(offloaded) == per_layer
    assert planner.offloaded_layer_bytes(load_config(LLAMA3_8B, [*layout, "train.offload_modules=[core_attn]"])) \
        == 8192 * (2 * (2 * 4096 + 3 * 1024) + 4 * 32)
    held = [planner.stage_activation_bytes(cfg, 128256, 8, 0) for cfg in (kept, offloaded)]
    assert held[0] - held[1] == 30 * per_layer

# ---------------------------------------------------------------------------------------------
# Against megatron-core on CPU (multi-process)

BF16, FP32 = "train.precision=bf16", "train.precision=fp32"
TP1 = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"]
PP1 = ["parallel.pipeline_model_parallel_size=1"]
TIED = "model.untie_embeddings_and_output_weights=false"



def test_recipe_auto_layout_is_the_planners_best_and_valid():
    """parallel.auto=true in the recipe: the planner's best layout for the started world size."""
    from recipes.pretrain import planned_layout

    def with_planned_layout(config: str, overrides: list[str]):
        return load_config(config, [*overrides, *planned_layout(load_config(config, overrides), 8, 8)])

    config = "configs/llama3_8b_8gpu_bf16.yaml"
    overrides = ["parallel.auto=true", "parallel.auto_gpu=h100-80gb"]
    cfg = with_planned_layout(config, overrides)
    expected = best_layout(load_config(config), 8, 8, "h100-80gb")
    p, t = cfg.parallel, cfg.train
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
            t.micro_batch_size) == (expected["parallel.tensor_model_parallel_size"],
                                    expected["parallel.pipeline_model_parallel_size"],
                                    expected["parallel.context_parallel_size"], expected["train.micro_batch_size"])
    validate_layout(cfg, 8, te_available=True, compute_capability=(9, 0))
    fsdp = [*overrides, "parallel.use_megatron_fsdp=true"]  # the planner decides: ZeRO-1 fits, so no Megatron-FSDP
    assert not with_planned_layout(config, fsdp).parallel.use_megatron_fsdp


# The calibration points: throughputs measured on one H100 80GB, torch 2.11, megatron-core 0.16.1, no TE
# (docs/measurements/h100-2026-11-23.md §1-3), by (compiled layers, overrides of configs/llama3_2_1b_1gpu_bf16.yaml):
# the 1B recipe, and the benchmark's 1.2B shape with one micro batch per step. KERNEL_EFFICIENCY, LAYER_OVERHEAD_S and
# OPTIMIZER_BYTES_PER_ELEMENT are fitted to them.
BENCHMARK_SHAPE = ("model.num_layers=16", "model.hidden_size=2048", "model.num_attention_heads=32",
                   "model.num_query_groups=8", "model.ffn_hidden_size=8192", "model.vocab_size=32000",
                   "model.untie_embeddings_and_output_weights=true", "model.seq_length=4096")
H100_CALIBRATION = {
    (False, ("train.micro_batch_size=2",)): 44_200,
    (False, ("train.micro_batch_size=4",)): 47_900,
    (True, ("train.micro_batch_size=2",)): 53_200,
    (True, ("train.micro_batch_size=4",)): 54_600,
    (False, (*BENCHMARK_SHAPE, "train.micro_batch_size=1", "train.global_batch_size=1")): 38_612,
    **{(True, (*BENCHMARK_SHAPE, f"train.micro_batch_size={mbs}", f"train.global_batch_size={mbs}")): measured
       for mbs, measured in ((1, 44_626), (2, 55_211), (4, 64_053))},
}


@pytest.mark.parametrize("compiled, overrides", list(H100_CALIBRATION))
def test_the_planner_predicts_each_h100_calibration_point_within_5_percent(compiled, overrides):
    cfg = load_config(ROOT / "configs" / "llama3_2_1b_1gpu_bf16.yaml",
                      [*overrides, f"train.compile={str(compiled).lower()}", "model.attention_backend=local"])
    e = planner.estimate(cfg, 1, 8, GPUS["h100-80gb"], planner.model_vocab_size(cfg))
    measured = H100_CALIBRATION[(compiled, overrides)]
    print(f"{overrides} compiled {compiled}: predicted {e.tokens_per_s_per_gpu:,.0f}, measured {measured:,}")
    assert abs(e.tokens_per_s_per_gpu / measured - 1) <= 0.05


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_the_planner_counts_the_runs_flops(recipe):
    """One FLOP count: the planner's per-stage sum over the layers and the output layer is the run's model FLOPs
    (what the run log's MFU divides), and its MFU is those FLOPs over its step time."""
    cfg = load_config(ROOT / "configs" / recipe)
    vocab = cfg.model.vocab_size or 32_000
    shape = planner.RankShape.of(cfg, vocab)
    run_flops = model_flops_per_token(cfg, vocab)
    assert planner.stage_flops_per_token(shape, range(shape.layers), True, None) == pytest.approx(run_flops, rel=1e-12)
    gpus = re.search(r"_(\d+)gpu_", recipe)
    world = int(gpus[1]) if gpus else 8  # the tiny recipes: a node
    e = planner.estimate(cfg, world, 8, GPUS["h100-80gb"], vocab)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    assert e.mfu == pytest.approx(run_flops * tokens / (e.time["step"] * world * 989e12), rel=1e-9)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_planner_ranks_larger_micro_batches_of_the_1b_recipe_faster(compiled):
    """Measured: mbs 4 ≥ mbs 2 > mbs 1 (per-micro-batch costs that small micro batches do not amortise)."""
    speed = {}
    for mbs in (1, 2, 4):
        cfg = load_config(ROOT / "configs" / "llama3_2_1b_1gpu_bf16.yaml",
                          [f"train.micro_batch_size={mbs}", f"train.compile={str(compiled).lower()}"])
        speed[mbs] = planner.estimate(cfg, 1, 8, GPUS["h100-80gb"], planner.model_vocab_size(cfg)).tokens_per_s_per_gpu
    assert speed[4] >= speed[2] > speed[1], speed


def test_the_readme_recipe_table_gives_each_recipes_checkpoint_size_and_retention():
    """The planner's byte count (and its write time at 10 GB/s) and the YAML's keep_last/keep_every, as the
    README's recipe table states them."""
    import re

    from megatron_ext.planner import checkpoint_bytes, model_vocab_size

    readme = (ROOT / "README.md").read_text()
    from megatron_ext.metrics.units import format_duration

    rows = re.findall(r"^\| `(configs/[^`]+)` \|.*\| ([\d.,]+) GB \(([^)]+)\) \| ([^|]+) \|$", readme, re.M)
    assert sorted(row[0] for row in rows) == sorted(f"configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml"))
    for path, size, write_time, kept in rows:
        cfg = load_config(ROOT / path)
        gb = checkpoint_bytes(cfg, model_vocab_size(cfg)) / 1e9
        assert f"{gb:,.{2 if gb < 1 else 0}f}" == size and format_duration(gb / 10) == write_time, (path, gb, size)
        ck = cfg.checkpoint
        assert kept.strip() == (f"newest {ck.keep_last} + every {ck.keep_every:,}th" if ck.keep_last else "all"), path


def test_megatron_fsdp_is_estimated_as_asked_and_searched_after_zero1():
    """ZeRO-2 shards the gradients, ZeRO-3 the parameters too (two layers gathered at a time); the optimizer state
    is ZeRO-1's; the search ranks a fitting DDP/ZeRO-1 layout before any ZeRO-2/3 one."""
    base = ["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false",
            "parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=1", "parallel.sequence_parallel=true"]
    zero = {level: load_config(LLAMA3_8B, [*base, *extra]) for level, extra in [
        (1, []), (2, ["parallel.use_megatron_fsdp=true", "parallel.data_parallel_sharding_strategy=optim_grads"]),
        (3, ["parallel.use_megatron_fsdp=true"])]}
    est = {level: planner.estimate(cfg, 8, 8, GPUS["h100-80gb"], planner.model_vocab_size(cfg))
           for level, cfg in zero.items()}
    mem = {level: e.memory for level, e in est.items()}
    dp = est[1].layout.dp  # TP2 × DP4
    assert mem[2]["grads"] == pytest.approx(mem[1]["grads"] / dp, rel=0.01) and mem[2]["params"] == mem[1]["params"]
    assert mem[3]["params"] == pytest.approx(mem[1]["params"] / dp, rel=0.01) and mem[3]["grads"] == mem[2]["grads"]
    assert mem[1]["optimizer"] == pytest.approx(mem[3]["optimizer"], rel=0.01)
    assert mem[3]["total"] < mem[2]["total"] < mem[1]["total"]
    assert est[3].layout.label().endswith("distopt ZeRO-3 mbs1 recompute=none")
    assert "Megatron-FSDP ZeRO-3 shards the gradients and the parameters" in planner.explain(est[3],
                                                                                             GPUS["h100-80gb"])
    assert est[3].overrides["parallel.data_parallel_sharding_strategy"] == "optim_grads_params"
    assert est[3].time["dp_comm"] > est[2].time["dp_comm"] > 0  # it gathers the parameters twice per micro batch
    ranked = [e for e in plan(zero[3], 8, 8, "h100-80gb") if e.fits]
    first_fsdp = next(i for i, e in enumerate(ranked) if e.layout.sharding)
    assert first_fsdp > 0 and all(e.layout.sharding for e in ranked[first_fsdp:])


def test_hsdp_shards_within_a_node_and_all_reduces_across_nodes():
    """8B at TP1 × DP32 on 4 nodes of 8: ZeRO-3 over all 32 ranks, or HSDP in 4 groups of one node each (8× the
    shard, the gathers on NVLink instead of across nodes, one all-reduce of the node's gradient shard per step);
    with the optimizer state also sharded across the groups (outer optim) that part is ZeRO-3's again."""
    base = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
            "parallel.pipeline_model_parallel_size=1", "parallel.context_parallel_size=1",
            "parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false",
            "parallel.use_megatron_fsdp=true", "train.global_batch_size=256"]
    hsdp = ["parallel.num_distributed_optimizer_instances=4"]
    cfgs = {name: load_config(LLAMA3_8B, [*base, *extra]) for name, extra in [
        ("zero3", []), ("hsdp", hsdp), ("hsdp_optim", [*hsdp, "parallel.outer_dp_sharding_strategy=optim"])]}
    est = {name: planner.estimate(cfg, 32, 8, GPUS["h100-80gb"], planner.model_vocab_size(cfg))
           for name, cfg in cfgs.items()}
    mem = {name: e.memory for name, e in est.items()}
    for part in ("grads", "optimizer"):
        assert mem["hsdp"][part] == pytest.approx(4 * mem["zero3"][part], rel=1e-3), part
    assert mem["hsdp_optim"]["optimizer"] == mem["zero3"]["optimizer"]
    assert mem["hsdp_optim"]["params"] == mem["hsdp"]["params"] and mem["hsdp_optim"]["grads"] == mem["hsdp"]["grads"]
    assert est["hsdp"].time["dp_comm"] < est["zero3"].time["dp_comm"]
    assert est["hsdp"].layout.label().endswith("ZeRO-3 HSDP4 mbs1 recompute=none")
    assert "HSDP keeps the sharding's gathers inside each of the 4 groups" in planner.explain(est["hsdp"],
                                                                                                GPUS["h100-80gb"])
    assert est["hsdp"].overrides["parallel.num_distributed_optimizer_instances"] == 4
    searched = {L.replicas for L in planner.candidate_layouts(cfgs["zero3"], 32, 8) if L.sharding and L.tp == 1}
    assert searched == {1, 4}


def test_offloaded_optimizer_state_must_fit_in_the_nodes_host_memory():
    """The 405B shape fits on 40 H100s only with all of its optimizer state in host memory (1235 GiB a node): on
    nodes of 1 TiB (75 % of it for offload) it does not (1 TiB per 8 GPUs)."""
    import dataclasses

    cfg = load_config(ROOT / "configs" / "llama3_1_405b_40gpu_bf16.yaml")
    best = plan(cfg, 40, 8, "h100-80gb")[0]
    assert best.fits and best.layout.offload == 1.0
    assert 1000 * GIB < 8 * best.memory["host"] < 0.75 * 2048 * GIB
    small_nodes = dataclasses.replace(GPUS["h100-80gb"], host_memory_gib=128.0)
    assert not any(e.fits for e in plan(cfg, 40, 8, small_nodes))


def test_moe_layouts_search_ep_and_expert_tp_and_split_the_experts_memory():
    """tiny_moe on 8 GPUs: EP and ETP are searched with the other dimensions, more EP holds fewer experts per GPU
    (parameters, gradients and their optimizer state), and the explanation says what EP costs."""
    cfg = load_config(ROOT / "configs" / "tiny_moe.yaml", ["model.vocab_size=4096", "train.global_batch_size=64"])
    ranked = plan(cfg, 8, 8, "h100-80gb")
    layouts = {e.layout: e for e in ranked}
    assert {e.layout.ep for e in ranked} == {1, 2, 4, 8} and {e.layout.etp for e in ranked} == {None, 1}
    base = next(L for L in layouts if (L.tp, L.pp, L.cp, L.ep, L.etp, L.distopt, L.vpp, L.recompute, L.mbs,
                                       L.sharding) == (1, 1, 1, 1, None, True, None, None, 1, None))
    by_ep = [layouts[dataclasses.replace(base, ep=ep)] for ep in (1, 2, 4, 8)]
    for fewer, more in zip(by_ep, by_ep[1:]):
        assert more.memory["params"] < fewer.memory["params"] and more.time["moe_comm"] > 0
    assert by_ep[0].time["moe_comm"] == 0
    text = explain(by_ep[-1], GPUS["h100-80gb"])
    assert "EP8 puts 1/8 of each layer's experts on a GPU" in text and "expert-DP=1" in text


def test_uneven_pipeline_stages_are_searched_and_modelled_as_the_model_builds_them():
    """126 layers (the 405B shape) plan at PP 4, 8 and 16 with near-even stages; the planner's per-stage memory
    and its slowest stage follow the split megatron-core builds (config.schema.pipeline_stage_layers)."""
    assert planner.pipeline_splits(126, 8) == [(15, 15)]  # 15 + 6 × 16 + 15
    assert planner.pipeline_splits(126, 16) == [(7, 7)]
    assert planner.pipeline_splits(126, 4) == [(32, 32), (31, 31)]
    assert planner.pipeline_splits(127, 2) == [(None, 63)]  # at PP 2 only the last is set
    assert planner.pipeline_splits(32, 4) == [(None, None)]
    cfg = load_config(ROOT / "configs" / "llama3_1_405b_40gpu_bf16.yaml")
    pps = {(layout.pp, layout.first_stage_layers, layout.last_stage_layers)
           for layout in planner.candidate_layouts(cfg, 128, 8, micro_batch_sizes=(1,))}
    assert {(4, 32, 32), (4, 31, 31), (8, 15, 15), (16, 7, 7)} <= pps
    uneven = load_config(ROOT / "configs" / "llama3_1_405b_40gpu_bf16.yaml",
                         ["parallel.tensor_model_parallel_size=8", "parallel.pipeline_model_parallel_size=8",
                          "parallel.virtual_pipeline_model_parallel_size=null", "parallel.context_parallel_size=1",
                          "parallel.num_layers_in_first_pipeline_stage=15",
                          "parallel.num_layers_in_last_pipeline_stage=15", "model.attention_backend=local"])
    vocab = planner.model_vocab_size(uneven)
    shape = planner.RankShape.of(uneven, vocab)
    layer = sum(shape.layer_params())
    middle, last = (planner.rank_static_bytes(uneven, 128, r, 0, vocab)["params"] // 2 for r in (1, 7))
    assert middle == 16 * layer and last == 15 * layer + shape.hidden + shape.vocab * shape.hidden // 8
    e = planner.estimate(uneven, 128, 8, GPUS["h100-80gb"], vocab)
    recompute, mbs = uneven.train.recompute_granularity, uneven.train.micro_batch_size
    slowest = max(planner.stage_flops_per_token(shape, range(15, 31), False, recompute),
                  planner.stage_flops_per_token(shape, range(111, 126), True, recompute))
    expected = e.num_microbatches * mbs * uneven.model.seq_length * slowest / 8 / (
        989e12 * planner.kernel_efficiency(uneven))
    assert e.time["compute"] == pytest.approx(expected, rel=1e-9)


def test_the_planner_and_its_command_run_where_torch_and_megatron_core_cannot_be_imported():
    """Planning is arithmetic on the config: `python -m recipes.plan` runs on a laptop or a login node without
    torch, megatron-core or numpy (their imports fail in this process)."""
    import subprocess
    import sys

    blocked = ("import importlib.abc, runpy, sys\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'megatron', 'numpy', 'transformer_engine'):\n"
               "            raise ImportError('blocked: ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "sys.argv = ['recipes.plan', '--config', 'configs/llama3_8b_8gpu_bf16.yaml', '--gpus', '8',\n"
               "            '--gpu', 'h100-80gb', '--json']\n"
               "runpy.run_module('recipes.plan', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)


@pytest.mark.parametrize("layers, pp, vpp, first, last", [
    (8, 2, None, None, None), (8, 2, 2, None, None), (10, 4, None, 1, 3), (12, 3, 2, 2, 4), (14, 4, 2, None, 2)])
def test_each_chunk_holds_the_layers_megatron_core_builds_there(layers, pp, vpp, first, last):
    """The planner's chunks number their layers as megatron-core's model build does (which layers are MoE layers,
    and so each stage's parameters, activations and FLOPs, follow from it)."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_ext.config.schema import pipeline_stage_layers

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"model.num_layers={layers}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.virtual_pipeline_model_parallel_size={vpp or 'null'}",
        f"parallel.num_layers_in_first_pipeline_stage={first if first is not None else 'null'}",
        f"parallel.num_layers_in_last_pipeline_stage={last if last is not None else 'null'}"])
    config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    for rank in range(pp):
        built = []
        for chunk in range(vpp or 1):
            offset = get_transformer_layer_offset(config, vp_stage=chunk if vpp else None, pp_rank=rank)
            built.append(range(offset, offset + get_num_layers_to_build(config, vp_stage=chunk if vpp else None,
                                                                         pp_rank=rank)))
        chunks = planner.static_memory.stage_chunks(tuple(pipeline_stage_layers(cfg)), vpp, rank)
        assert [layers for layers, _, _ in chunks] == built, rank


def test_the_shapes_remembered_for_a_config_section_follow_its_changes():
    """ModelShape.of and RankShape.of remember a section's shapes (the search asks hundreds of thousands of times),
    but a section changed in place, a list value included, gets its new shapes."""
    from megatron_ext.config.shape import ModelShape
    from megatron_ext.planner.layout import RankShape

    cfg = load_config(ROOT / "configs" / "tiny_deepseek.yaml")
    assert ModelShape.of(cfg.model).num_layers == 4 and RankShape.of(cfg, 512).layers == 4
    moe_layers = ModelShape.of(cfg.model).moe_layers
    cfg.model.num_layers = 6
    cfg.model.moe_layer_freq = [0, 1, 1, 1, 1, 1]
    assert ModelShape.of(cfg.model).num_layers == 6 and RankShape.of(cfg, 512).layers == 6
    cfg.model.moe_layer_freq[1] = 0  # in place
    assert ModelShape.of(cfg.model).moe_layers == (0, 0, 1, 1, 1, 1) != moe_layers
    assert RankShape.of(cfg, 512).model.moe_layers == (0, 0, 1, 1, 1, 1)
    cfg.parallel.tensor_model_parallel_size = 2
    assert RankShape.of(cfg, 512).tp == 2


@pytest.mark.parametrize("name, gpus", [("llama3_8b_8gpu_bf16.yaml", 8), ("tiny_moe.yaml", 4),
                                        ("llama3_1_405b_40gpu_bf16.yaml", 40)])
def test_the_printed_overrides_are_the_config_the_planner_estimated(name, gpus):
    """One mapping from a layout to a config: the top layouts' overrides, set with load_config as a user sets them,
    give the layout and the estimate (step time and memory) the planner ranked them by."""
    from megatron_ext.hardware import GPUS
    from megatron_ext.planner import Layout, estimate, model_vocab_size, plan

    path = ROOT / "configs" / name
    cfg = load_config(path)
    for ranked in [e for e in plan(cfg, gpus, 8, "h100-80gb") if e.fits][:3]:
        applied = load_config(path, [f"{k}={'null' if v is None else str(v).lower()}"
                                     for k, v in ranked.overrides.items()])
        again = estimate(applied, gpus, 8, GPUS["h100-80gb"], model_vocab_size(applied))
        assert Layout.of(applied, gpus) == ranked.layout
        assert (again.time, again.memory) == (ranked.time, ranked.memory), ranked.layout.label()
