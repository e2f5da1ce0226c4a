"""Published throughput runs re-planned: each row of a published-runs CSV (docs/published-runs.csv's columns) as a
recipe config at the row's own model, layout, precision and features, its planned tokens/s/GPU beside the published
one. ``python -m recipes.plan --published FILE.csv`` prints the comparison; docs/planner.md holds it as a table.

A row names a recipe config (``config``: configs/<config>.yaml) and shape overrides; its precision, sharding,
recompute and features map onto the recipe keys that switch the same thing in megatron-core (:data:`FEATURE_KEYS`).
Rows the project cannot express say why in one line (a model family without a recipe, a GPU the planner has no entry
for, a layout the recipe refuses); features it cannot express yet are planned without, so their error shows.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, get_args

from megatron_ext.config.schema import RecipeConfig, RecomputeModule, load_config
from megatron_ext.config.shape import ModelShape, padded_vocab_size
from megatron_ext.errors import ConfigError
from megatron_ext.hardware import GPUS
from megatron_ext.planner.estimate import Estimate, estimate
from megatron_ext.planner.layout import model_vocab_size
from megatron_ext.planner.search import accepts_layout, pipeline_splits

COLUMNS = ("idx", "source", "model", "config", "shape_overrides", "gpu", "num_gpus", "precision", "seq_length",
           "global_batch_size", "micro_batch_size", "tp", "pp", "vpp", "cp", "ep", "etp", "sharding", "recompute",
           "features", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "notes")
PRECISION_KEYS: dict[str, list[str]] = {
    "bf16": [], "fp8-delayed": ["train.fp8=delayed"], "fp8-tensorwise": ["train.fp8=tensorwise"],
    "fp8-blockwise": ["train.fp8=blockwise"], "mxfp8": ["train.fp8=mxfp8"], "nvfp4": ["train.fp4=nvfp4"]}
# torch's FSDP (torchtitan, NeMo AutoModel, llm-foundry) planned as Megatron-FSDP's ZeRO-3, the same sharding
SHARDING_KEYS: dict[str, list[str]] = {
    "dist-opt": ["parallel.use_distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
                 "parallel.overlap_param_gather=true"],
    "ddp": ["parallel.use_distributed_optimizer=false", "parallel.overlap_grad_reduce=true"],
    **{name: ["parallel.use_megatron_fsdp=true", "parallel.data_parallel_sharding_strategy=optim_grads_params",
              "parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"]
       for name in ("megatron-fsdp", "torch-fsdp2", "torch-fsdp1")}}
# The features column's switches as the recipe keys that set them in megatron-core; `None`: the project has no
# switch for it (planned without). torch's async TP is the same overlap as TransformerEngine's TP comm overlap.
FEATURE_KEYS: dict[str, Optional[list[str]]] = {
    "tp-comm-overlap": ["parallel.tp_comm_overlap=true"], "async-tp": ["parallel.tp_comm_overlap=true"],
    # DP overlap is on in every distributed-optimizer row (SHARDING_KEYS: Megatron-Bridge's and NeMo's default);
    # a row whose source turned it off says no-dp-overlap
    "dp-overlap": [],
    "no-dp-overlap": ["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"],
    "ep-a2a-overlap": ["parallel.overlap_moe_expert_parallel_comm=true"],
    "deepep": ["model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=deepep"],
    "hybridep": ["model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=hybridep"],
    "cuda-graphs-layer": ["train.cuda_graph_impl=transformer_engine"],
    "cuda-graphs-full": ["train.cuda_graph_impl=full_iteration"],
    "fp8-param-gather": ["train.fp8_param_gather=true"],
    "force-balanced": ["model.moe_router_force_load_balancing=true"],
    # torch-native layers (torchtitan, llm-foundry), as the project's local layers (which run no FP8: an FP8 row is
    # planned in BF16, and its error shows), compiled with torch-compile
    "torch-native": ["model.attention_backend=local"],
    "torch-compile": ["train.compile=true"],
    "token-drop": [],  # the row's shape overrides set the capacity
    "mtp": [],  # the recipe's own MTP layers (rows without them override model.mtp_num_layers=null)
}
MICRO_BATCH_SIZES = (1, 2, 4, 8)
# pipeline units megatron-core's pipeline layout can give to other than decoder layers: the embedding, the loss, an
# MTP layer
PIPELINE_UNITS_BESIDE_LAYERS = 3  # tried where a row does not publish its micro batch: the fastest that fits


@dataclass(frozen=True)
class PublishedRun:
    """One row of a published-runs CSV, its cells as written."""

    cells: dict[str, str]

    def __getitem__(self, column: str) -> str:
        return self.cells[column].strip()

    @property
    def idx(self) -> int:
        return int(self["idx"])

    def published_tokens_per_s_per_gpu(self, cfg: Optional[RecipeConfig] = None) -> tuple[Optional[float], bool]:
        """(tokens/s/GPU, derived): the published tokens/s/GPU; where only TFLOP/s/GPU is published, that divided by
        the model's FLOPs per token (:class:`ModelShape`'s count: causal attention, as Megatron-Bridge and Megatron-LM
        count today; non-causal where the row's notes say its source counts so, as Megatron-LM's 2024 table, NeMo
        2.0 and llm-foundry did), flagged derived; (None, False) without either."""
        if self["tokens_per_s_per_gpu"]:
            return float(self["tokens_per_s_per_gpu"]), False
        if self["tflops_per_gpu"] and cfg is not None:
            vocab = padded_vocab_size(model_vocab_size(cfg), cfg.model.make_vocab_size_divisible_by, 1)
            causal = "non-causal" not in self["notes"]
            per_token = ModelShape.of(cfg.model).flops_per_token(vocab, causal=causal)
            return float(self["tflops_per_gpu"]) * 1e12 / per_token, True
        return None, False

    def overrides(self) -> list[str]:
        """The row as recipe overrides: shape, batch, layout, precision, sharding, recompute and features (raises
        ConfigError naming what has no recipe key)."""
        keys = self["shape_overrides"].split()
        keys += [f"model.seq_length={self['seq_length']}", f"train.global_batch_size={self['global_batch_size']}",
                 "train.precision=bf16", "model.attention_backend=te", "train.compile=false",
                 "train.recompute_granularity=null", "optimizer.optimizer_cpu_offload=false"]
        tp, vpp = int(self["tp"]), int(self["vpp"] or 1)
        keys += [f"parallel.tensor_model_parallel_size={tp}", f"parallel.sequence_parallel={str(tp > 1).lower()}",
                 f"parallel.pipeline_model_parallel_size={self['pp']}",
                 f"parallel.virtual_pipeline_model_parallel_size={vpp if vpp > 1 else 'null'}",
                 "parallel.num_layers_in_first_pipeline_stage=null", "parallel.num_layers_in_last_pipeline_stage=null",
                 f"parallel.context_parallel_size={self['cp'] or 1}",
                 f"parallel.expert_model_parallel_size={self['ep'] or 1}",
                 f"parallel.expert_tensor_parallel_size={self['etp'] or 'null'}"]
        keys += _lookup(PRECISION_KEYS, self["precision"], "precision")
        keys += _lookup(SHARDING_KEYS, self["sharding"], "sharding")
        recompute, _, modules = self["recompute"].partition(":")
        if recompute == "full":
            keys.append("train.recompute_granularity=full")
        elif recompute == "selective":
            known = [m for m in modules.split(",") if m in get_args(RecomputeModule)]  # torchtitan's "op": default
            keys += ["train.recompute_granularity=selective", f"train.recompute_modules=[{','.join(known)}]"]
        for feature in self["features"].split():
            name, _, count = feature.partition(":")
            if name == "activation-offload":
                keys.append(f"train.cpu_offloading_num_layers={count}")
                continue
            keys += _lookup(FEATURE_KEYS, name, "feature") or []
        return keys


def _lookup(table: dict[str, Any], value: str, column: str) -> Any:
    if value not in table:
        raise ConfigError(f"{column} {value!r} has no recipe key here (known: {', '.join(table)})")
    return table[value]


def read_published(path: str | Path) -> list[PublishedRun]:
    """The rows of a published-runs CSV; ConfigError naming the file when its header is not :data:`COLUMNS`."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ConfigError(f"{path}: the header must be {','.join(COLUMNS)} (got {','.join(reader.fieldnames or [])})")
        return [PublishedRun(row) for row in reader]


@dataclass
class Replanned:
    """One row's verdict: planned against published tokens/s/GPU, or why it was not planned."""

    run: PublishedRun
    estimate: Optional[Estimate] = None
    published: Optional[float] = None
    derived: bool = False  # the published value derived from TFLOP/s (no tokens/s published)
    reason: Optional[str] = None
    parts: list[tuple[str, float]] = field(default_factory=list)  # the largest time parts, seconds per step
    notes: list[str] = field(default_factory=list)  # how the row's layout was made expressible

    @property
    def planned(self) -> Optional[float]:
        return self.estimate.tokens_per_s_per_gpu if self.estimate else None

    @property
    def error(self) -> Optional[float]:
        """(planned − published) / published."""
        if self.planned is None or not self.published:
            return None
        return self.planned / self.published - 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"idx": self.run.idx, "model": self.run["model"], "gpu": self.run["gpu"],
                               "num_gpus": int(self.run["num_gpus"]), "precision": self.run["precision"]}
        if self.reason:
            return {**out, "reason": self.reason}
        assert self.estimate is not None and self.error is not None
        return {**out, "planned_tokens_per_s_per_gpu": round(self.planned or 0.0, 1),
                "published_tokens_per_s_per_gpu": round(self.published or 0.0, 1), "published_derived": self.derived,
                "error": round(self.error, 4), "fits": self.estimate.fits,
                "layout": self.estimate.layout.label(), "time_s": {k: round(v, 4) for k, v in self.parts},
                "notes": self.notes}


def replan(run: PublishedRun, configs_dir: Path) -> Replanned:
    """The row planned at its own layout, precision and features (the fastest published-or-fitting micro batch when
    the row publishes none)."""
    if not run["config"]:
        return Replanned(run, reason=f"{run['model']}: no recipe of this model family here")
    if run["gpu"] not in GPUS:
        return Replanned(run, reason=f"GPU {run['gpu']!r} has no planner entry ({', '.join(GPUS)})")
    gpu, world = GPUS[run["gpu"]], int(run["num_gpus"])
    sizes = (int(run["micro_batch_size"]),) if run["micro_batch_size"] else MICRO_BATCH_SIZES
    estimates: list[Estimate] = []
    refusal: Optional[str] = None
    try:
        base = run.overrides()
    except ConfigError as e:
        return Replanned(run, reason=str(e))
    cfg = published_cfg = None
    notes: list[str] = []
    for mbs in sizes:
        try:
            cfg = load_config(configs_dir / f"{run['config']}.yaml", [*base, f"train.micro_batch_size={mbs}"])
        except ConfigError as e:
            refusal = refusal or str(e)
            continue
        published_cfg = cfg
        cfg, notes = _expressible_pipeline(cfg)
        try:
            accepts_layout(cfg, world, gpu)
        except ConfigError as e:  # a rule of this project's (what it has verified), not a layout megatron-core lacks
            notes = [*notes, f"the recipe refuses it: {e}"]
        estimates.append(estimate(cfg, world, gpu.node_gpus, gpu, model_vocab_size(cfg)))
    if not estimates:
        return Replanned(run, reason=f"refused: {refusal}")
    best = max(estimates, key=lambda e: (e.fits or len(sizes) == 1, e.tokens_per_s_per_gpu))
    published, derived = run.published_tokens_per_s_per_gpu(published_cfg)
    if published is None:
        return Replanned(run, estimate=best, reason="no published throughput (neither tokens/s nor TFLOP/s)")
    parts = sorted(((k, v) for k, v in best.time.items() if k != "step"), key=lambda kv: -kv[1])[:3]
    return Replanned(run, best, published, derived, parts=parts, notes=notes)


def _expressible_pipeline(cfg: RecipeConfig) -> tuple[RecipeConfig, list[str]]:
    """`cfg` with a pipeline split the recipe can build: layers that do not divide over PP×VPP get the planner's
    near-even split without virtual stages (the published runs balance them with megatron-core's pipeline layout,
    which has no recipe key here), said in the returned note."""
    p, layers = cfg.parallel, cfg.model.num_layers
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if layers % (pp * vpp) == 0:
        return cfg, []
    pad = -layers % (pp * vpp)
    if vpp > 1 and pad <= PIPELINE_UNITS_BESIDE_LAYERS:
        freq = cfg.model.moe_layer_freq
        model = dataclasses.replace(cfg.model, num_layers=layers + pad, moe_layer_freq=freq if isinstance(freq, int)
                                    else [*freq, *[freq[-1]] * pad])
        return dataclasses.replace(cfg, model=model), [
            f"{layers} layers over PP{pp}×VPP{vpp}: planned as {layers + pad} even ones, the embedding, loss (and MTP) "
            "taking a layer's place as megatron-core's pipeline layout (account_for_embedding/loss_in_pipeline_split) "
            "runs them"]
    first, last = pipeline_splits(layers, pp)[0]
    parallel = dataclasses.replace(p, virtual_pipeline_model_parallel_size=None,
                                   num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    dropped = f" without its {vpp} virtual stages" if vpp > 1 else ""
    return dataclasses.replace(cfg, parallel=parallel), [
        f"{layers} layers over PP{pp}×VPP{vpp}: planned{dropped} with first/last stages of {first}/{last} layers"]


def bf16_above_fp8(results: list[Replanned]) -> list[tuple[int, int]]:
    """(BF16 row, FP8 row) pairs of the same model, GPU count and type and layout where the BF16 row is planned
    faster than the FP8 run was published: what the planner must never claim."""
    def key(run: PublishedRun) -> tuple[str, ...]:
        return tuple(run[c] for c in ("model", "gpu", "num_gpus", "tp", "pp", "vpp", "cp", "ep"))

    published = [(key(r.run), r.run.idx, r.published) for r in results if r.published is not None
                 and r.run["precision"] != "bf16"]
    return [(r.run.idx, idx) for r in results if r.planned is not None and r.run["precision"] == "bf16"
            for k, idx, fp8 in published if k == key(r.run) and r.planned > fp8]


def summary(results: list[Replanned]) -> dict[str, Any]:
    """Rows planned, median and 90th-percentile |error|, the worst row, the share within 20 %, and BF16 rows planned
    above a published FP8 run of the same layout."""
    errors = sorted((abs(r.error), r.run.idx) for r in results if r.error is not None)
    if not errors:
        return {"rows": len(results), "planned": 0}
    values = [e for e, _ in errors]
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return {"rows": len(results), "planned": len(values), "median_abs_error": round(statistics.median(values), 4),
            "p90_abs_error": round(p90, 4), "within_20_percent": round(sum(v <= 0.2 for v in values) / len(values), 4),
            "worst": {"idx": errors[-1][1], "abs_error": round(errors[-1][0], 4)},
            "bf16_planned_above_published_fp8": bf16_above_fp8(results)}
