"""A Hugging Face model directory as read before any conversion: its config.json (parsed, each field checked as it is
taken) and its safetensors files (one file, or shards + index), every tensor checked against the names and shapes
the config implies before a byte is converted. Shared by the model families (:mod:`megatron_ext.convert.families`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from megatron_ext.config.schema import YARN_KEYS
from megatron_ext.errors import ConversionError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config.json's names
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some old exports contain; recomputed by both sides
_FP8_SCALES = "weight_scale_inv"  # DeepSeek-V3's published FP8 checkpoint: one scale per 128x128 weight block
# OpenAI's MXFP4 checkpoints (GPT-OSS): a stacked expert tensor W [experts, in, out] stored as NAME_blocks [experts,
# out, in/32, 16] bytes and NAME_scales [experts, out, in/32] E8M0 exponents (the OCP MX format: 32 values per scale)
MXFP4 = ("_blocks", "_scales")
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by 4-bit code


def read_config_json(hf_dir: Path) -> tuple[dict[str, Any], str]:
    """``hf_dir/config.json`` as a dict, and its path for error messages."""
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} not found (a Hugging Face model directory has config.json)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return config, str(path)


def shared_config_fields(shape: Any, dtype: torch.dtype, bos_id: Optional[int], eos_id: Optional[int]
                         ) -> dict[str, Any]:
    """The config.json fields every family writes alike, from a family shape's attributes of the same names."""
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    return {
        "architectures": [shape.architecture],
        "model_type": shape.model_type,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tied,
        "attention_bias": False,
        "initializer_range": shape.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,  # the key transformers < 4.56 reads
    }


def rope_config_fields(theta: float, rope: dict[str, Any]) -> dict[str, Any]:
    """config.json's RoPE as transformers 5 writes it (``rope_parameters``) and as the published configs do
    (``rope_theta`` + ``rope_scaling``, null without scaling): `rope` is the scaling's ``rope_type`` and numbers."""
    return {"rope_theta": theta, "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
            "rope_parameters": {"rope_theta": theta, **rope}}


def shared_recipe_fields(shape: Any, tensor_parallel_size: int) -> dict[str, Any]:
    """The ``model.*`` keys every family's recipe sets alike, from a family shape's attributes (the vocabulary padded
    to load under TP 1, 2, 4, 8 and `tensor_parallel_size`, the sequence length capped)."""
    from megatron_ext.convert.weight_mapping import SEQ_LENGTH_CAP, vocab_padding

    return {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_heads,
        "seq_length": min(shape.max_position_embeddings, SEQ_LENGTH_CAP),
        "vocab_size": shape.vocab_size,
        "make_vocab_size_divisible_by": vocab_padding(shape.vocab_size, tensor_parallel_size)[0],
        "rotary_base": shape.rope_theta,
        "layernorm_epsilon": shape.rms_norm_eps,
        "init_method_std": shape.init_std,
        "untie_embeddings_and_output_weights": not shape.tied,
    }


def field(config: dict[str, Any], name: str, source: str, default: Any = None, kind: type = int) -> Any:
    """config[name] (or `default`), refused unless a positive int, a positive number or a bool as `kind` says."""
    value = config.get(name, default)
    if value is None:
        raise ConversionError(f"{source}: required field {name!r} is missing")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConversionError(f"{source}: {name}={value!r} must be a positive integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ConversionError(f"{source}: {name}={value!r} must be a positive number")
    if kind is bool and not isinstance(value, bool):
        raise ConversionError(f"{source}: {name}={value!r} must be true or false")
    return value


def refuse_unless(config: dict[str, Any], source: str, plain: Mapping[str, Any], why: str) -> None:
    """One ConversionError for the first of `plain`'s fields that config.json sets to another value (absent: plain)."""
    for name, value in plain.items():
        if config.get(name, value) != value:
            raise ConversionError(f"{source}: {name}={config[name]!r} is not supported ({why}; only {name}={value!r} "
                                  "converts)")


# YaRN's numbers under transformers' names: the recipe's (YARN_KEYS) but for the factor
HF_YARN = tuple({"rotary_scaling_factor": "factor"}.get(key, key) for key in YARN_KEYS)


def yarn_rope(config: dict[str, Any], source: str, unrounded_allowed: bool = False
              ) -> tuple[float, Optional[tuple[float, ...]], bool]:
    """(rope_theta, YaRN's six numbers (YARN_KEYS' order) or None, whether YaRN rounds its correction range) from the
    legacy (rope_scaling) or transformers-5 form; `unrounded_allowed`: ``truncate=false`` converts (megatron-core's
    GPT YaRN takes it, its multi-latent attention's does not)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConversionError(f"{source}: rope_theta={theta!r} must be a positive number")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None, True
    if rope_type != "yarn":
        raise ConversionError(f"{source}: rope_type={rope_type!r} is not supported (none/default, or yarn)")
    truncate = params.get("truncate", True)
    refuse_unless(params, f"{source} rope_parameters", {"attention_factor": None, "partial_rotary_factor": 1.0,
                                                         **({} if unrounded_allowed else {"truncate": True})},
                  "megatron-core's YaRN derives the attention factor from mscale/mscale_all_dim" + (
                      "" if unrounded_allowed else " and, under multi-latent attention, rounds the correction range"))
    if not isinstance(truncate, bool):
        raise ConversionError(f"{source}: rope_parameters.truncate={truncate!r} must be true or false")
    factor = field(params, "factor", source, kind=float)
    original = field(params, "original_max_position_embeddings", source)
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):  # optional; null or 0: transformers' default
        if params.get(name):
            field(params, name, source, kind=float)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # transformers uses mscale/mscale_all_dim only when both are set (else mscale 1, no all-dim term): so does this
    if not (mscale and mscale_all_dim) and mscale not in (None, 1, 1.0):
        raise ConversionError(f"{source}: rope_parameters.mscale={mscale!r} without mscale_all_dim is not supported "
                              "(transformers then ignores mscale, megatron-core does not): give both, or mscale=1")
    values = {"factor": float(factor), "original_max_position_embeddings": int(original),
              "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
              "mscale": float(mscale or 1.0), "mscale_all_dim": float(mscale_all_dim or 0.0)}
    return float(theta), tuple(values[name] for name in HF_YARN), truncate


class SafetensorsReader:
    """Tensors of a Hugging Face directory (one model.safetensors, or shards + index), read one at a time.

    safetensors maps each file into memory, and every page a read touched stays in this process's resident set while
    the file is open: :meth:`release` closes them (reopened when next read), so a conversion reading a layer at a
    time holds one layer's pages, not the model's."""

    def __init__(self, hf_dir: Path):
        index = hf_dir / "model.safetensors.index.json"
        single = hf_dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
            files = {name: hf_dir / file for name, file in weight_map.items()}
        elif single.is_file():
            files = None
        else:
            found = sorted(p.name for p in hf_dir.glob("*.bin")) if hf_dir.is_dir() else []
            hint = f" (found {', '.join(found)}: convert .bin weights to safetensors first)" if found else ""
            raise ConversionError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json "
                                  f"found{hint}")
        self._handles: dict[Path, Any] = {}
        self.files: dict[str, Path] = {}
        for path in sorted(set(files.values())) if files is not None else [single]:
            if not path.is_file():
                raise ConversionError(f"{path} not found (listed in {index.name})")
            for name in self._handle(path).keys():
                if files is not None and files.get(name) != path:
                    continue  # the index decides which shard owns a name
                self.files[name] = path
        self.release()
        if files is not None:
            for name, path in files.items():
                if name not in self.files:
                    raise ConversionError(f"{path}: tensor {name!r} listed in {index.name} is missing")

    def _handle(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ConversionError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[path]

    def release(self) -> None:
        """Close every file (their pages leave this process's resident set)."""
        self._handles.clear()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> Optional[torch.dtype]:
        return _SAFETENSORS_DTYPES.get(self._handle(self.files[name]).get_slice(name).get_dtype())

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.files[name]).get_tensor(name)

    def get_row(self, name: str, row: int) -> torch.Tensor:
        """``get(name)[row]``, reading that row's bytes only (one expert of a tensor stacking a layer's experts); an
        MXFP4-stored one dequantized (bf16, as transformers dequantizes it)."""
        if name not in self.files:
            blocks, scales = (self._handle(self.files[name + suffix]).get_slice(name + suffix)[row]
                              for suffix in MXFP4)
            return dequantize_mxfp4(blocks, scales).transpose(-1, -2)
        return self._handle(self.files[name]).get_slice(name)[row]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., rows, groups, 16] bytes and [..., rows, groups] exponents → [..., rows, groups·32] values: each byte two
    E2M1 code points (the low nibble first), each group of 32 times 2^(exponent − 127)."""
    code_points = torch.tensor(_FP4_E2M1, dtype=dtype)
    values = torch.stack([code_points[(blocks & 0x0F).long()], code_points[(blocks >> 4).long()]], dim=-1)
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


def _mxfp4_stand_ins(reader: SafetensorsReader, expected: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The blocks' and scales' shapes for each expected [experts, in, out] tensor the files hold in MXFP4 instead."""
    shapes = {}
    for name, dims in expected.items():
        if name not in reader.files and name + MXFP4[0] in reader.files and len(dims) == 3 and dims[1] % 32 == 0:
            experts, inputs, outputs = dims
            shapes[name + MXFP4[0]] = (experts, outputs, inputs // 32, 16)
            shapes[name + MXFP4[1]] = (experts, outputs, inputs // 32)
    return shapes


def check_tensors(reader: SafetensorsReader, expected: Mapping[str, tuple[int, ...]], copies: Mapping[str, str],
                  config_path: Path, described: str) -> torch.dtype:
    """Every `expected` tensor present with its shape, nothing else but `copies` (optional names that must equal the
    tensor each names: a tied output layer, an MTP layer's own copy of the embedding); returns the weights' dtype."""
    fp8 = next((name for name in reader.files if name.endswith(_FP8_SCALES)), None)
    if fp8 is not None:
        raise ConversionError(f"{reader.files[fp8]}: {fp8!r} is a block-FP8 weight's scale: dequantize the checkpoint "
                              "to bfloat16 first (e.g. DeepSeek-V3's inference/fp8_cast_bf16.py)")
    stand_ins = _mxfp4_stand_ins(reader, expected)
    expected = {**{name: dims for name, dims in expected.items() if name + MXFP4[0] not in stand_ins}, **stand_ins}
    for name, want in expected.items():
        if name not in reader.files:
            raise ConversionError(f"tensor {name!r} is missing from the safetensors files of {config_path.parent}")
        got = reader.shape(name)
        if got != want:
            raise ConversionError(f"{reader.files[name]}: tensor {name!r} has shape {list(got)}, but "
                                  f"{config_path} implies {list(want)}")
    for name in reader.files:
        if name in expected or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name in copies:
            if not torch.equal(reader.get(name), reader.get(copies[name])):
                raise ConversionError(f"{reader.files[name]}: {name} differs from {copies[name]}, which it shares in "
                                      f"this model as {config_path} describes it")
            continue
        raise ConversionError(f"{reader.files[name]}: unexpected tensor {name!r} for {described} as described by "
                              f"{config_path}")
    dtype = reader.dtype("model.embed_tokens.weight")
    if dtype is None:
        raise ConversionError(f"{reader.files['model.embed_tokens.weight']}: weights must be float32, "
                              "bfloat16 or float16")
    return dtype


DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default


def shard_size_bytes(max_shard_size: str) -> int:
    """`max_shard_size` (transformers' size strings: ``5GB``, ``100KB``, decimal units) in bytes, through
    huggingface_hub's own parser (the one save_pretrained's sharding uses); ConversionError naming it otherwise."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        return parse_size_to_int(max_shard_size)
    except ValueError as e:
        raise ConversionError(f"--max-shard-size={max_shard_size!r}: {e}") from None


def progress_line(done_what: str, done: int, total: int, started: float) -> str:
    """One line of a long conversion's progress: what was just done, how far, the time so far and the time left
    (`started`: time.monotonic() at the start)."""
    elapsed = time.monotonic() - started
    return f"  {done_what} ({done} of {total}), {elapsed:.0f} s, about {elapsed / done * (total - done):.0f} s left"


class ShardWriter:
    """A model's tensors written as Hugging Face writes a model, as they arrive in any order: one
    ``model.safetensors`` when they fit in `max_shard_size`, else ``model-0000k-of-0000n.safetensors`` shards of at
    most that size (a larger tensor alone in its shard) with ``model.safetensors.index.json``; with `share` (i, n)
    only every n-th shard from the i-th (the i-th of n writers, each in its own process). The split is planned
    up front from the names, shapes and dtype (`planned`, in order) by huggingface_hub's
    ``split_torch_state_dict_into_shards``, as transformers' save_pretrained splits; a shard is written (and its
    tensors let go) as soon as its last tensor arrives, with a line and the time left."""

    def __init__(self, planned: Mapping[str, tuple[tuple[int, ...], torch.dtype]], directory: Path,
                 max_shard_size: str, progress: Callable[[str], None] = print, share: tuple[int, int] = (0, 1)):
        from huggingface_hub import split_torch_state_dict_into_shards

        meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in planned.items()}
        self.split = split_torch_state_dict_into_shards(meta, max_shard_size=shard_size_bytes(max_shard_size))
        self.directory, self.progress = directory, progress
        # this writer's share of the files, (i, n): every n-th from the i-th (a worker of n writes its share)
        worker, workers = share
        self.owned = [file for k, file in enumerate(self.split.filename_to_tensors) if k % workers == worker]
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}  # a shard's arrived tensors, by file
        self.written: list[str] = []
        self.started = time.monotonic()

    def wants(self, name: str) -> bool:
        """Whether tensor `name` goes into a file of this writer's share."""
        return self.split.tensor_to_filename[name] in self.owned

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """`name` arrived (left alone when it belongs to another writer's share)."""
        from safetensors.torch import save_file

        if not self.wants(name):
            return
        filename = self.split.tensor_to_filename[name]
        arrived = self.waiting.setdefault(filename, {})
        arrived[name] = tensor.contiguous()
        if len(arrived) < len(self.split.filename_to_tensors[filename]):
            return
        save_file({key: arrived[key] for key in self.split.filename_to_tensors[filename]},
                  str(self.directory / filename), metadata={"format": "pt"})
        del self.waiting[filename]
        self.written.append(filename)
        if self.split.is_sharded:
            self.progress(progress_line(f"wrote {filename}", len(self.written), len(self.owned), self.started))

    def finish(self) -> list[str]:
        """Checks that every file of this writer's share was written; the index too (when sharded) where the share is
        all of them; the file names."""
        unwritten = [name for file in self.owned if file not in self.written
                     for name in self.split.filename_to_tensors[file] if name not in self.waiting.get(file, {})]
        if unwritten:
            raise RuntimeError(f"weight mapping bug: tensors that never arrived: {unwritten[:5]}")
        if len(self.owned) == len(self.split.filename_to_tensors):
            self.write_index()
        return list(self.split.filename_to_tensors)

    def write_index(self) -> None:
        """``model.safetensors.index.json`` (when sharded), once every share is written."""
        if self.split.is_sharded:
            index = {"metadata": dict(self.split.metadata), "weight_map": dict(self.split.tensor_to_filename)}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
