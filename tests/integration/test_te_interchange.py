"""Checkpoints move between the local layer spec + torch AdamW (CPU, bare GPU, HF imports) and the
TransformerEngine spec + TE FusedAdam (the NGC container), both ways, model and optimizer.

TE cannot be installed here: ``tests/workers/te_standin.py`` builds megatron-core's own TE spec from stand-in
modules with TE's checkpoint keys and an Adam with TE FusedAdam's state contract. A run stopped at step 3
under one and resumed under the other must continue the uninterrupted local run. Each of the three
defects this guards against (a per-param 'step' given to FusedAdam, a float step or missing
``bias_correction`` in its param groups, the TE final norm's ``_extra_state`` missing from local
checkpoints) makes one of these tests fail.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from megatron_ext.model.llama import transformer_engine_available
from tests.conftest import parity_overrides
from tests.launch import ROOT, SINGLE_PROCESS, max_relative_difference, read_scalars, run_pretrain

GOLDEN_KEYS = ROOT / "tests" / "golden" / "te_spec_sharded_keys.txt"
GOLDEN_MOE_KEYS = ROOT / "tests" / "golden" / "te_spec_moe_sharded_keys.txt"
# the same models as megatron-core's HybridModel (model.model_class=hybrid)
GOLDEN_HYBRID_KEYS = {"": ROOT / "tests" / "golden" / "te_spec_hybrid_sharded_keys.txt",
                      "_moe": ROOT / "tests" / "golden" / "te_spec_moe_hybrid_sharded_keys.txt"}
STEPS, STOP = 6, 3
TE = ["model.attention_backend=te"]
# Same math in both specs (the stand-ins fuse nothing numerically), so differences from the single-process run
# are summation order only (DP2's reduction, the other optimizer): measured loss ≤ 1.2e-7, grad-norm ≤ 2.2e-7. A
# lost optimizer state (moments or step) moves the loss after the resume by > 1e-4.
TOLERANCE = {"train/lm_loss": 1e-6, "train/grad_norm": 2e-5}
DP2 = (2, ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
           "parallel.sequence_parallel=false"])
ONE_NON_DISTRIBUTED = (1, [*SINGLE_PROCESS, "parallel.use_distributed_optimizer=false"])


@functools.cache
def _keys(real_te: bool = False) -> dict[str, list[str]]:
    """The sharded keys of the 2-layer dense and MoE models under each spec, from one process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "tests.workers.te_standin", "keys", *(["--real-te"] * real_te)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def _golden(path: Path) -> list[str]:
    return sorted(line for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_te_shaped_spec_presents_megatron_cores_te_checkpoint_keys():
    golden = _golden(GOLDEN_KEYS)
    assert _keys()["te"] == golden
    # The local spec saves the same keys, except the TE final norm's FP8 metadata.
    assert _keys()["local"] == [k for k in golden if k != "decoder.final_layernorm._extra_state ShardedObject"]


@pytest.mark.skipif(not transformer_engine_available(), reason="real TransformerEngine needs a GPU and TE")
def test_real_transformer_engine_saves_the_golden_keys():
    """What the stand-ins are checked against, checked against TE itself where it runs (`make gpu-check`)."""
    assert _keys(real_te=True)["te"] == _golden(GOLDEN_KEYS)
    assert _keys(real_te=True)["te_moe"] == _golden(GOLDEN_MOE_KEYS)


def test_moe_layers_save_the_same_keys_under_either_spec():
    """TE's grouped experts save SequentialMLP's keys (megatron-core's contract), and the local spec's pre-MLP norm
    is saved under the TE spec's key: only the TE norms' FP8 metadata is TE's own."""
    golden = _golden(GOLDEN_MOE_KEYS)
    assert _keys()["te_moe"] == golden
    te_only = {f"decoder.{norm}._extra_state ShardedObject" for norm in ("final_layernorm", "layers.pre_mlp_layernorm")}
    assert _keys()["local_moe"] == [k for k in golden if k not in te_only]


@pytest.mark.parametrize("moe", ["", "_moe"], ids=["dense", "moe"])
def test_hybrid_model_keys_are_gptmodels_under_the_one_key_table(moe):
    """The HybridModel's keys under either spec are its golden keys (the TE norms' FP8 metadata apart under the local
    spec), and the key table of checkpoint/model_class.py turns them into GPTModel's golden keys: position 2i and
    2i + 1 into layer i (GPTModel's homogeneous keys: the layer index becomes an axis), final_norm into
    final_layernorm; only HybridModel's empty output-layer _extra_state has no GPT key."""
    import re

    from megatron_ext.checkpoint.model_class import gpt_parameter_name

    golden = _golden(GOLDEN_HYBRID_KEYS[moe])
    assert _keys()[f"te{moe}_hybrid"] == golden
    te_only = re.compile(r"decoder\.(final_norm|layers\.\d+\.pre_mlp_layernorm)\._extra_state ")
    assert _keys()[f"local{moe}_hybrid"] == [k for k in golden if not te_only.match(k)]
    as_gpt = {re.sub(r"decoder\.layers\.\d+\.", "decoder.layers.", gpt_parameter_name(k, hybrid=True)) for k in golden}
    assert as_gpt == {*_golden(GOLDEN_MOE_KEYS if moe else GOLDEN_KEYS), "output_layer._extra_state ShardedObject"}


def _run(module: str, layout: tuple[int, list[str]], overrides: list[str]) -> str:
    nproc, layout_overrides = layout
    proc = run_pretrain(nproc, [*layout_overrides, *overrides], module=module)
    return proc.stdout + proc.stderr


def _assert_continues(run_tb: Path, full_tb: Path, steps: range) -> None:
    """`run_tb` logged exactly `steps`, each matching the uninterrupted local single-process run."""
    for tag, tolerance in TOLERANCE.items():
        run = read_scalars(run_tb, tag)
        assert sorted(run) == list(steps), (tag, sorted(run))
        full = {k: v for k, v in read_scalars(full_tb, tag).items() if k in steps}
        diff = max_relative_difference(run, full)
        print(f"{run_tb.parent.name} {tag} steps {steps.start}-{steps.stop - 1}: max rel diff {diff:.1e}")
        assert diff <= tolerance, (tag, run, full)


def test_a_dp_reshardable_checkpoint_is_refused_by_the_other_spec(tmp_path):
    """The default mid-run format writes the optimizer's flat buffers as they are; another layer spec's buffers
    hold other parameters at those offsets, so loading it is one clear error, not misplaced Adam moments."""
    run = [*SINGLE_PROCESS, "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
           "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.seq_length=64", "train.train_iters=2",
           "train.global_batch_size=2", "train.micro_batch_size=2", "train.eval_iters=0",
           "logging.tensorboard_dir=null"]
    ckpt = tmp_path / "ckpt"
    run_pretrain(1, [*run, "train.exit_interval=1", f"checkpoint.save={ckpt}"])
    proc = run_pretrain(1, [*run, *TE, f"checkpoint.load={ckpt}"], module="tests.workers.te_standin", check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "dp_reshardable format" in proc.stderr and "model.attention_backend: local → te" in proc.stderr, \
        proc.stderr[-3000:]


@pytest.mark.parametrize("layout", [DP2, ONE_NON_DISTRIBUTED], ids=["dp2_distributed_optimizer",
                                                                   "1proc_plain_optimizer"])
def test_checkpoints_move_between_layer_specs_both_ways(initial_weights, single_process_reference, layout, tmp_path):
    """The parity matrix's single-process run (local spec) is the reference; local 1..3 saved and resumed under TE
    4..6, and TE 1..3 saved and resumed under local 4..6 (a TE → TE resume is a plain resume, covered by the resume
    tests; dropped for the suite's time)."""
    def overrides(name: str, *extra: str) -> list[str]:
        return [*parity_overrides(initial_weights, tmp_path / name / "tb", STEPS), "checkpoint.save=null", *extra]

    for saved_under, resumed_under in [("local", "te"), ("te", "local")]:
        save_dir = tmp_path / f"ckpt_{saved_under}"
        # from the local-spec initial weights: under TE that is the weights-only path of defect 3
        log = _run("tests.workers.te_standin" if saved_under == "te" else "recipes.pretrain", layout,
                   overrides(f"{saved_under}_first", *(TE if saved_under == "te" else []),
                             f"train.exit_interval={STOP}", f"checkpoint.save={save_dir}",
                             "checkpoint.optimizer_format=fully_reshardable"))
        expected = "layer spec: TransformerEngine" if saved_under == "te" else "layer spec: megatron-core local"
        assert expected in log, log[-3000:]
        _assert_continues(tmp_path / f"{saved_under}_first" / "tb", single_process_reference, range(1, STOP + 1))
        name = f"{saved_under}_to_{resumed_under}"
        log = _run("tests.workers.te_standin" if resumed_under == "te" else "recipes.pretrain", layout,
                   overrides(name, *(TE if resumed_under == "te" else []), f"checkpoint.load={save_dir}"))
        assert f"resumed from {save_dir} at iteration {STOP}" in log, log[-3000:]
        if resumed_under == "te":
            assert "FusedAdamStandIn" in log, log[-3000:]
        _assert_continues(tmp_path / name / "tb", single_process_reference, range(STOP + 1, STEPS + 1))


def test_hybrid_model_under_te_trains_from_gptmodels_local_checkpoint(initial_weights, single_process_reference,
                                                                     tmp_path):
    """megatron-core's HybridModel built from the TE spec (model.model_class=hybrid) starts from the parity matrix's
    initial weights (a local-spec GPTModel checkpoint: other class, other spec) and trains as the single-process
    local GPTModel run does."""
    log = _run("tests.workers.te_standin", ONE_NON_DISTRIBUTED,
               [*parity_overrides(initial_weights, tmp_path / "tb", STEPS), "checkpoint.save=null", *TE,
                "model.model_class=hybrid"])
    assert "layer spec: TransformerEngine" in log, log[-3000:]
    _assert_continues(tmp_path / "tb", single_process_reference, range(1, STEPS + 1))


def test_hugging_face_import_trains_the_same_under_either_spec(tmp_path):
    """With document masking on, over documents of 15-75 tokens in sequences of 64, so that the TE spec takes each
    micro batch (2 sequences) as TransformerEngine's packed sequence (THD) and the local spec takes document ids: the
    same losses either way."""
    from data_prep.preprocess import preprocess
    from recipes import convert
    from tests.corpora import code_docs, write_jsonl
    from tests.integration.test_convert import DATA, make_hf_model

    hf = make_hf_model(tmp_path / "hf", vocab=4100, kv_heads=2, tied=False, extra={}, save={}, seed=5)
    # A world of one on CPU patches torch for the process: import in a spawned one.
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        ckpt = pool.submit(convert.import_hf, hf, tmp_path / "imported").result()
    short_documents = preprocess([str(write_jsonl(tmp_path / "docs.jsonl", code_docs(300)))], str(tmp_path / "docs"),
                                 str(DATA / "tokenizer.model")).prefixes[0]
    common = [f"checkpoint.load={ckpt}",
              f"data.blend=[{short_documents}]", f"data.tokenizer_model={DATA / 'tokenizer.model'}",
              f"data.path_to_cache={tmp_path / 'cache'}", "model.seq_length=64", "train.train_iters=3",
              "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
              "train.eval_interval=1000", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "checkpoint.save=null",
              "data.reset_attention_mask=true", "data.reset_position_ids=true"]
    for spec, module, extra in [("local", "recipes.pretrain", []), ("te", "tests.workers.te_standin", TE)]:
        log = run_pretrain(1, [*common, *extra, f"logging.tensorboard_dir={tmp_path / spec}"], module=module,
                           config=ckpt / "recipe.yaml")
        log = log.stdout + log.stderr
        assert f"loaded weights of {ckpt}" in log or f"resumed from {ckpt}" in log, log[-3000:]
        assert ("TransformerEngine's packed-sequence (THD) attention" if spec == "te" else "SDPA's boolean mask") in log
    for tag, tolerance in TOLERANCE.items():
        diff = max_relative_difference(read_scalars(tmp_path / "te", tag), read_scalars(tmp_path / "local", tag))
        print(f"HF import, TE-shaped vs local {tag}: max rel diff {diff:.1e}")
        assert diff <= tolerance, tag


def test_te_detection_is_megatron_cores_own():
    """The layer spec follows megatron-core's TE decision (its TE wrappers need ``transformer_engine.pytorch``),
    not whether a module named ``transformer_engine`` imports: here one does, megatron-core's spec module says
    yes (its own check is that import), its wrappers say no — and so must we, or the TE spec is built from mocks."""
    probe = ("import sys, types; from megatron_ext.model.llama import transformer_engine_available; "
             "from megatron.core.models.gpt import gpt_layer_specs; "
             "sys.modules['transformer_engine'] = types.ModuleType('transformer_engine'); import transformer_engine; "
             "gpt_layer_specs.HAVE_TE = True; print(transformer_engine_available())")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=True)
    assert proc.stdout.split() == ["False"], proc.stdout + proc.stderr


def test_a_broken_transformer_engine_is_one_clear_error(tmp_path):
    """TE's top-level package imports while its torch part is missing (a half-finished install): megatron-core
    0.16.1 fails at import; the recipe says so in one line instead of a traceback."""
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text('__version__ = "2.11.0"\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "recipes.pretrain", "--config", str(ROOT / "configs" / "tiny.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "TransformerEngine is installed but incomplete or broken" in proc.stderr, \
        proc.stderr
