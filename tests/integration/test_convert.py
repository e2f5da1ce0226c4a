"""Hugging Face Llama and Qwen3 import/export, proven against transformers: logits, bit-exact round trips, training.

Small random LlamaForCausalLM and Qwen3ForCausalLM models (hidden 64, 2 layers) are saved with transformers, imported,
and run through our megatron-core model: logits must match transformers' to 1e-4 (fp32) at TP1
in-process and at TP2 / TP2×PP2 under torchrun; export must give back every tensor bit-exactly; an
imported model trains with the recipe and its export reproduces the trained model's logits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.checkpoint import manifest
from megatron_ext.checkpoint.layout import has_manifest, latest_iteration
from megatron_ext.config.schema import load_config
from megatron_ext.config.shape import padded_vocab_size
from megatron_ext.config.validate import validate_layout
from recipes import convert
from tests.launch import ROOT, launch_prefix, read_scalars, run_module
from tests.workers.convert_logits_worker import checkpoint_logits

TOLERANCE = 1e-4  # fp32; measured differences are 2e-6..2e-5 (summation order, SDPA vs eager attention)
DATA = ROOT / "data" / "tiny"
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# name: vocab, query groups, tied embeddings, extra config fields, save_pretrained arguments (, architecture)
CASES = {
    # GQA, untied, a vocabulary that needs padding, llama3 RoPE scaling, sharded safetensors + index
    "gqa_untied_v1003": dict(vocab=1003, kv_heads=2, tied=False,
                             extra={"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE},
                             save={"max_shard_size": "100KB"}),
    # MHA, tied embeddings, one model.safetensors
    "mha_tied_v1000": dict(vocab=1000, kv_heads=4, tied=True, extra={}, save={}),
    # Qwen3: per-head q/k norms, a head dimension other than hidden / heads (as Qwen3-30B-A3B's 128 vs 2048 / 32)
    "qwen3_gqa_v1003": dict(vocab=1003, kv_heads=2, tied=False, extra={"rope_theta": 1e6, "head_dim": 32}, save={},
                            arch="qwen3"),
}
ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def make_hf_model(path: Path, vocab: int, kv_heads: int, tied: bool, extra: dict, save: dict,
                  seed: int = 0, dtype: torch.dtype = torch.float32, arch: str = "llama") -> Path:
    """A random fp32 LlamaForCausalLM (or Qwen3ForCausalLM) saved with save_pretrained; weights scaled so logits
    are O(1-10)."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in ARCHITECTURES[arch])
    torch.manual_seed(seed)
    config = config_class(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                          tie_word_embeddings=tied, rms_norm_eps=1e-5, **extra)
    model = scale_weights(model_class(config))
    model.to(dtype).save_pretrained(path, **save)
    return path


def scale_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights scaled so that logits are O(1-10): HF's init (std 0.02, unit norms) would hide mapping errors
    in tiny logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 1.0 if "embed" in name else param.shape[-1] ** -0.5)
    return model


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits for the model in `hf_dir` (its config.json's architecture), fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def safetensors_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def assert_same_model(original: Path, exported: Path, tokens: torch.Tensor) -> None:
    """`exported` holds every tensor of `original` bit for bit (names, dtypes, values), and gives its logits."""
    before, after = safetensors_state(original), safetensors_state(exported)
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert torch.equal(hf_logits(exported, tokens), hf_logits(original, tokens))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def imported(megatron, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Each case: its Hugging Face directory and the checkpoint imported from it (TP1 build, one process)."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for i, (name, case) in enumerate(CASES.items()):
        hf = make_hf_model(root / name / "hf", seed=i, **case)
        ckpt = megatron(convert.import_hf, hf, root / name / "ckpt")
        out[name] = {"hf": hf, "ckpt": ckpt, "root": root / name}
    return out


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------------------------------------
# In-process (TP1)


def test_padded_vocab_is_the_same_for_tp_1_2_4_8():
    from megatron_ext.convert.weight_mapping import vocab_padding

    for vocab in (1000, 1003, 4100, 32000, 128256, 151936):
        divisor, padded = vocab_padding(vocab, 1)
        assert vocab <= padded < vocab + 8
        assert {padded_vocab_size(vocab, divisor, tp) for tp in (1, 2, 4, 8)} == {padded}
    assert vocab_padding(128256, 1) == (16032, 128256)  # Llama 3: no padding rows at all
    divisor, padded = vocab_padding(1003, 3)  # an unusual TP joins the sizes it is portable to
    assert {padded_vocab_size(1003, divisor, tp) for tp in (1, 2, 3, 4, 6, 8)} == {padded}


@pytest.mark.parametrize("case", CASES)
def test_import_reproduces_transformers_logits_at_tp1(megatron, imported, tokens, case):
    paths = imported[case]
    ours = megatron(checkpoint_logits, paths["ckpt"], tokens)
    theirs = hf_logits(paths["hf"], tokens)
    diff = max_diff(ours, theirs)
    print(f"{case} TP1: max |Δlogit| = {diff:.2e} (max |logit| {theirs.abs().max():.2f})")
    assert diff <= TOLERANCE
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits


@pytest.mark.parametrize("case", CASES)
def test_recipe_yaml_describes_the_imported_model(imported, case):
    paths, spec = imported[case], CASES[case]
    cfg = load_config(paths["ckpt"] / "recipe.yaml")
    hf_config = json.loads((paths["hf"] / "config.json").read_text())
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size,
            m.kv_channels, m.vocab_size) == (2, 64, 4, spec["kv_heads"], 160, spec["extra"].get("head_dim", 16),
                                             spec["vocab"])
    assert m.qk_layernorm is (spec.get("arch") == "qwen3")
    assert m.untie_embeddings_and_output_weights is not spec["tied"]
    assert m.seq_length == hf_config["max_position_embeddings"] and m.layernorm_epsilon == 1e-5
    assert m.rotary_base == spec["extra"].get("rope_theta", 10000.0)
    assert m.rope_scaling_factor == (8.0 if "rope_scaling" in spec["extra"] else None)
    assert cfg.checkpoint.pretrained_checkpoint == str(paths["ckpt"]) and cfg.train.precision == "fp32"
    assert cfg.checkpoint.load == "auto" and cfg.checkpoint.save == f"runs/{cfg.recipe.name}/checkpoints"
    assert (cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters) == (3.0e-5, 100)  # continued pretraining
    validate_layout(cfg, world_size=1)
    # written like a training checkpoint: verifiable (manifest), kept by retention, named by the tracker
    assert manifest.verify(paths["ckpt"] / "iter_0000000") is None and latest_iteration(paths["ckpt"]) == 0
    assert has_manifest(paths["ckpt"] / "iter_0000000")
    rows = {padded_vocab_size(spec["vocab"], m.make_vocab_size_divisible_by, tp) for tp in (1, 2, 4, 8)}
    assert len(rows) == 1


@pytest.mark.parametrize("case", CASES)
def test_export_gives_back_every_tensor_bit_exactly(megatron, imported, tokens, case):
    paths = imported[case]
    exported = megatron(convert.export_hf, paths["ckpt"], paths["root"] / "exported")
    assert_same_model(paths["hf"], exported, tokens)
    before, after = (json.loads((d / "config.json").read_text()) for d in (paths["hf"], exported))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings"):
        assert after[key] == before[key], key


def test_export_shards_as_transformers_does_and_the_shards_import_again(megatron, imported, tokens, tmp_path):
    """--max-shard-size 100KB: model-0000k-of-0000n.safetensors shards of at most 100 KB (a larger tensor alone) with
    the index transformers and huggingface_hub read; from_pretrained gives the original's logits, and the shards
    import back to the same weights. Below the size (the default 5GB) a model stays one model.safetensors."""
    paths = imported["gqa_untied_v1003"]
    exported = megatron(convert.export_hf, paths["ckpt"], tmp_path / "sharded", "100KB")
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in exported.glob("*.safetensors"))
    assert len(shards) > 3 and shards == sorted(set(index["weight_map"].values()))
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", name) for name in shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in safetensors_state(exported).values())
    for shard in exported.glob("*.safetensors"):
        tensors = safetensors_state_of_file(shard)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 100_000, shard
    assert_same_model(paths["hf"], exported, tokens)
    again = megatron(convert.export_hf, megatron(convert.import_hf, exported, tmp_path / "reimported"),
                     tmp_path / "whole")
    assert sorted(p.name for p in again.glob("*.safetensors")) == ["model.safetensors"]
    assert_same_model(paths["hf"], again, tokens)


def safetensors_state_of_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def test_bf16_checkpoints_round_trip_bit_exactly(megatron, tmp_path):
    hf = make_hf_model(tmp_path / "hf", vocab=1003, kv_heads=1, tied=False, extra={}, save={},
                       dtype=torch.bfloat16)
    ckpt = megatron(convert.import_hf, hf, tmp_path / "ckpt")
    assert load_config(ckpt / "recipe.yaml").train.precision == "bf16"
    exported = megatron(convert.export_hf, ckpt, tmp_path / "exported")
    original, roundtrip = safetensors_state(hf), safetensors_state(exported)
    assert sorted(roundtrip) == sorted(original)
    for name, tensor in original.items():
        assert tensor.dtype == roundtrip[name].dtype == torch.bfloat16, name
        assert torch.equal(roundtrip[name], tensor), name
    assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line naming the file or field, non-zero exit, nothing written


def _edited_copy(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _bad_inputs(hf: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    missing_config = _edited_copy(hf, tmp / "no_config")
    (missing_config / "config.json").unlink()
    no_weights = _edited_copy(hf, tmp / "no_weights")
    for f in no_weights.glob("*.safetensors*"):
        f.unlink()
    missing_shard = _edited_copy(hf, tmp / "missing_shard")
    sorted(missing_shard.glob("*.safetensors"))[-1].unlink()
    llama3_bad = {**LLAMA3_ROPE, "low_freq_factor": 2.0, "rope_theta": 500000.0}
    return {
        "no config.json": (missing_config, "config.json not found"),
        "no safetensors": (no_weights, "neither model.safetensors nor model.safetensors.index.json"),
        "shard missing": (missing_shard, "listed in model.safetensors.index.json"),
        "architecture": (_edited_copy(hf, tmp / "arch", architectures=["MistralForCausalLM"]),
                         "architectures=['MistralForCausalLM'] is not supported"),
        "rope yarn": (_edited_copy(hf, tmp / "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                      "rope_theta": 10000.0}),
                      "rope_parameters.rope_type='yarn' is not supported"),
        "rope llama3 constants": (_edited_copy(hf, tmp / "llama3", rope_parameters=llama3_bad),
                                  "low_freq_factor=2.0 is not supported"),
        "attention_bias": (_edited_copy(hf, tmp / "abias", attention_bias=True), "attention_bias=true"),
        "mlp_bias": (_edited_copy(hf, tmp / "mbias", mlp_bias=True), "mlp_bias=true"),
        "shape": (_edited_copy(hf, tmp / "shape", intermediate_size=192),
                  "'model.layers.0.mlp.gate_proj.weight' has shape [160, 64], but"),
        "layers": (_edited_copy(hf, tmp / "layers", num_hidden_layers=3),
                   "'model.layers.2.input_layernorm.weight' is missing"),
    }


def test_bad_hf_inputs_fail_with_one_clear_error(imported, tmp_path, capsys):
    hf = imported["gqa_untied_v1003"]["hf"]
    for name, (bad, message) in _bad_inputs(hf, tmp_path).items():
        code = convert.main(["import-hf", "--hf-dir", str(bad), "--output", str(tmp_path / f"out_{bad.name}")])
        text = capsys.readouterr().err.strip()
        assert code == 2 and text.startswith("error: ") and message in text and "\n" not in text, (name, code, text)
        assert not (tmp_path / f"out_{bad.name}").exists(), name
        assert not list(tmp_path.glob(f".out_{bad.name}*")), name  # no staging directory left behind


def test_this_process_stays_unpatched_by_the_cpu_backend(imported):
    from megatron_ext.distributed import cpu_backend

    assert cpu_backend._installed_mode is None


def test_bad_layouts_and_outputs_fail_with_one_clear_error(imported, tmp_path, capsys):
    paths = imported["gqa_untied_v1003"]
    cases = [
        (["import-hf", "--hf-dir", str(paths["hf"]), "--output", str(tmp_path / "tp3"),
          "--tensor-model-parallel-size", "3"], "model.num_attention_heads=4 is invalid"),
        (["import-hf", "--hf-dir", str(paths["hf"]), "--output", str(paths["ckpt"])], "already exists"),
        (["export-hf", "--checkpoint", str(paths["hf"]), "--output", str(tmp_path / "x")],
         "latest_checkpointed_iteration.txt not found"),
    ]
    bad_tracker = tmp_path / "bad_tracker"
    bad_tracker.mkdir()
    (bad_tracker / "latest_checkpointed_iteration.txt").write_text("iter_0000004\n")
    cases.append((["export-hf", "--checkpoint", str(bad_tracker), "--output", str(tmp_path / "y")],
                  "expected an iteration number, found 'iter_0000004'"))
    cases.append((["export-hf", "--checkpoint", str(paths["ckpt"]), "--output", str(tmp_path / "z"),
                   "--max-shard-size", "5 gigs"], "--max-shard-size='5 gigs': Unit 'GS' not supported"))
    for argv, message in cases:
        code = convert.main(argv)
        text = capsys.readouterr().err
        assert code == 2 and text.startswith("error: ") and message in text, (argv, code, text)


def test_cli_reports_errors_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, *launch_prefix(1), "-m", "recipes.convert", "import-hf", "--hf-dir", str(tmp_path),
                           "--output", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert proc.returncode == 2  # a user error, as for the trainer and data_prep
    expected = f"error: {tmp_path / 'config.json'} not found (a Hugging Face model directory has config.json)"
    assert proc.stderr.strip() == expected


# ---------------------------------------------------------------------------------------------
# Multi-process: TP2 / TP2×PP2 logits, training after import, export of the trained model


@pytest.fixture(scope="module")
def trained(megatron, tmp_path_factory) -> dict[str, Path]:
    """An imported GQA model with tied embeddings, trained 3 steps by the recipe at TP2 + SP, exported."""
    root = tmp_path_factory.mktemp("trained")
    hf = make_hf_model(root / "hf", vocab=4100, kv_heads=2, tied=True, extra={}, save={}, seed=3)
    ckpt = megatron(convert.import_hf, hf, root / "imported", tensor_parallel=2)
    proc = run_module(2, ["-m", "recipes.pretrain", "--config", str(ckpt / "recipe.yaml"),
                        f"data.blend=[{DATA / 'stdlib_text_document'}]",
                        f"data.tokenizer_model={DATA / 'tokenizer.model'}", "data.split=90,5,5",
                        f"data.path_to_cache={root / 'cache'}", "model.seq_length=64", "train.train_iters=3",
                        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
                        "train.eval_interval=1000", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
                        "optimizer.lr_warmup_iters=0",
                        f"checkpoint.save={root / 'trained'}", f"logging.tensorboard_dir={root / 'tb'}",
                        f"logging.log_dir={root / 'logs'}"])
    exported = megatron(convert.export_hf, root / "trained", root / "exported")
    return {"hf": hf, "imported": ckpt, "trained": root / "trained", "exported": exported, "tb": root / "tb",
            "log": proc.stdout, "root": root}


@pytest.fixture(scope="module")
def parallel_logits(imported, trained, tokens) -> dict[str, torch.Tensor]:
    """One torchrun of 4 processes: each checkpoint's logits under TP2 (DP2) and TP2×PP2 with SP (Qwen3's q/k norms
    over the heads of each TP rank)."""
    root = trained["root"]
    torch.save(tokens, root / "tokens.pt")
    layouts = [("gqa_untied_v1003", 2, 1, False), ("gqa_untied_v1003", 2, 2, True),
               ("mha_tied_v1000", 2, 2, True), ("qwen3_gqa_v1003", 2, 2, True), ("trained", 2, 2, True)]
    jobs = []
    for name, tp, pp, sp in layouts:
        ckpt = trained["trained"] if name == "trained" else imported[name]["ckpt"]
        jobs.append({"checkpoint": str(ckpt), "tp": tp, "pp": pp, "sp": sp,
                     "output": str(root / f"{name}_{tp}_{pp}.pt")})
    (root / "jobs.json").write_text(json.dumps({"tokens": str(root / "tokens.pt"), "jobs": jobs}))
    run_module(4, ["-m", "tests.workers.convert_logits_worker", str(root / "jobs.json")])
    return {f"{name}_tp{tp}_pp{pp}": torch.load(root / f"{name}_{tp}_{pp}.pt") for name, tp, pp, _ in layouts}


def test_tp2_and_tp2_pp2_reproduce_transformers_logits(imported, tokens, parallel_logits):
    for key, logits in parallel_logits.items():
        case = key.split("_tp")[0]
        if case == "trained":
            continue
        diff = max_diff(logits, hf_logits(imported[case]["hf"], tokens))
        print(f"{key}: max |Δlogit| = {diff:.2e}")
        assert diff <= TOLERANCE, key


def test_recipe_trains_from_the_imported_weights(trained):
    assert str(trained["imported"]) in trained["log"]  # the run reports what it loaded
    losses = read_scalars(trained["tb"], "train/lm_loss")
    assert sorted(losses) == [1, 2, 3] and all(0 < v < 100 for v in losses.values())
    before, after = safetensors_state(trained["hf"]), safetensors_state(trained["exported"])
    assert sorted(before) == sorted(after)
    # Three Adam steps at lr ≤ 1e-3 move each weight by at most ~3e-3: training started from the
    # imported weights (a fresh init would differ by O(1)) and did change them.
    changes = {name: (after[name] - before[name]).abs().max().item() for name in before}
    assert max(changes.values()) <= 5e-3, changes
    assert min(changes.values()) > 0, changes


def test_the_test_split_is_evaluated_once_at_the_end(trained):
    test_losses = read_scalars(trained["tb"], "test/lm_loss")
    assert list(test_losses) == [3] and read_scalars(trained["tb"], "test/ppl")[3] > 1
    assert f"test loss: {test_losses[3]:.4f} (perplexity" in trained["log"], trained["log"][-2000:]


def _generated(checkpoint: Path, prompt: str, *sampling: str) -> str:
    proc = subprocess.run([sys.executable, *launch_prefix(1), "-m", "recipes.generate", "--checkpoint", str(checkpoint), "--prompt",
                           prompt, "--max-new-tokens", "12", *sampling], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, text = proc.stdout.split("\n", 1)
    assert header == f"--- {prompt!r}" and text.startswith(prompt), proc.stdout
    return text[len(prompt):].rstrip("\n")


def test_generate_writes_what_transformers_greedy_decoding_writes(trained):
    """The TP2-trained checkpoint, read in one process by recipes.generate, against transformers' generate() on
    its export; top-k 1 sampling is greedy."""
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM

    prompt = "def main(argv):\n    "
    sp = spm.SentencePieceProcessor(model_file=str(DATA / "tokenizer.model"))
    ids = torch.tensor([sp.encode(prompt)])
    model = AutoModelForCausalLM.from_pretrained(trained["exported"], torch_dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    reference = sp.decode(out[0, ids.shape[1]:].tolist())
    assert reference and _generated(trained["trained"], prompt) == reference
    assert _generated(trained["trained"], prompt, "--temperature", "0.7", "--top-k", "1") == reference


LM_EVAL_TASK = """\
task: recipe_smoke
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
LM_EVAL_DOCS = [
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " banana"], "answer": 0},
    {"context": "import os\nprint(os.path.", "choices": ["join('a', 'b'))", "lorem ipsum"], "answer": 0},
    {"context": "for i in range(", "choices": ["10):", "tea time"], "answer": 0},
    {"context": "class Foo:\n    def __init__(self", "choices": ["):", " elephant"], "answer": 0},
]


def test_lm_evaluation_harness_scores_the_export_offline(trained, tmp_path):
    """lm-eval's `hf` model on the exported directory, a local multiple-choice task, no network: each choice's
    log-likelihood is the one transformers gives, and the accuracy follows from them."""
    import lm_eval  # noqa: F401  (pinned in requirements-dev.txt: a missing package fails here, not skips)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "recipe_smoke.yaml").write_text(LM_EVAL_TASK.format(data=data))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={trained['exported']},dtype=float32", "--tasks", "recipe_smoke",
                           "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "4",
                           "--output_path", str(tmp_path / "out"), "--log_samples"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]["recipe_smoke"]
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_recipe_smoke_*.jsonl")).open()]
    theirs = {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in samples}

    model = AutoModelForCausalLM.from_pretrained(trained["exported"], torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(trained["exported"])
    correct = 0
    for doc_id, doc in enumerate(LM_EVAL_DOCS):
        scores = []
        for choice in doc["choices"]:
            context = tokenizer(doc["context"], add_special_tokens=False)["input_ids"]
            whole = tokenizer(doc["context"] + choice, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([whole])
            logprobs = model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            scores.append(logprobs[len(context) - 1:].sum().item())
        assert [float(x) for x in theirs[doc_id]] == pytest.approx(scores, abs=1e-4), (doc, theirs[doc_id], scores)
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    assert results["acc,none"] == correct / len(LM_EVAL_DOCS), (results, correct)


def test_export_of_the_trained_checkpoint_reproduces_its_logits(megatron, trained, parallel_logits):
    tokens = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(11))
    theirs = hf_logits(trained["exported"], tokens)
    ours = megatron(checkpoint_logits, trained["trained"], tokens)
    diff = max_diff(ours, theirs)
    print(f"trained TP1: max |Δlogit| = {diff:.2e}")
    assert diff <= TOLERANCE
    # The same checkpoint resharded to TP2×PP2 (it was trained at TP2) on the shared tokens.
    shared = torch.load(trained["root"] / "tokens.pt")
    diff = max_diff(parallel_logits["trained_tp2_pp2"], hf_logits(trained["exported"], shared))
    print(f"trained TP2×PP2: max |Δlogit| = {diff:.2e}")
    assert diff <= TOLERANCE


def test_exported_tokenizer_matches_the_recipe_tokenizer(trained):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(trained["exported"])
    sp = spm.SentencePieceProcessor(model_file=str(DATA / "tokenizer.model"))
    config = json.loads((trained["exported"] / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (sp.bos_id(), sp.eos_id())
    for text in ["def f(x):\n    return x + 1  # add one", "import os\nprint(os.path.join('a', 'b'))"]:
        assert hf_tok(text)["input_ids"] == sp.encode(text)
        assert hf_tok.decode(sp.encode(text)) == text
