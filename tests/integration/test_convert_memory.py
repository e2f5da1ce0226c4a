"""export-hf in bounded memory: the converting process's peak resident set does not grow with the model's depth.

Two random bf16 Llamas of width 1024, 4 and 16 layers (the issue's measurement: 1.06 GB and 1.74 GB peaks before,
memory growing with the model), are imported, then exported by `python -m recipes.convert export-hf` in processes of
their own, each reporting its peak resident set (the kernel's VmHWM) at exit. Reading the checkpoint a layer at a time and
writing each 40 MB shard as it fills, the 16-layer export must peak within 10 % of the 4-layer one. With
``--workers 2`` (two processes, each writing every other shard) the files are the same, byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from recipes import convert
from tests.launch import ROOT, run_env

SHARD = "40MB"
# runs the converter's command line in this process and prints its peak resident set at exit: the kernel's VmHWM
# (KiB), this program's own (ru_maxrss would also count the image of the pytest process it was forked from)
PEAK = ("import runpy, sys; sys.argv = ['recipes.convert', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('recipes.convert', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print('PEAK_KIB', open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")


def _llama(path: Path, layers: int) -> Path:
    import transformers

    torch.manual_seed(layers)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _export_peak_gib(checkpoint: Path, output: Path, workers: int = 1) -> tuple[float, float]:
    """The converting process's peak resident set (GiB; its workers' apart) and the export's wall time (s)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PEAK, "export-hf", "--checkpoint", str(checkpoint), "--output",
                           str(output), "--max-shard-size", SHARD, "--workers", str(workers)], cwd=ROOT,
                          env=run_env({}), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a group at a time" in proc.stdout or workers > 1, proc.stdout[-2000:]
    return int(proc.stdout.split("PEAK_KIB")[-1]) / 2**20, time.monotonic() - started


def test_export_memory_does_not_grow_with_the_layers(megatron, tmp_path):
    peaks, seconds = {}, {}
    for layers in (4, 16):
        hf = _llama(tmp_path / f"hf{layers}", layers)
        checkpoint = megatron(convert.import_hf, hf, tmp_path / f"ckpt{layers}")
        peaks[layers], seconds[layers] = _export_peak_gib(checkpoint, tmp_path / f"out{layers}")
        index = json.loads((tmp_path / f"out{layers}" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1  # written in shards as they filled
    print(f"export-hf peak resident set: 4 layers {peaks[4]:.2f} GiB, 16 layers {peaks[16]:.2f} GiB "
          f"(model {16 * 12.6e6 * 2 / 2**30:.2f} GiB at 16 layers)")
    assert peaks[16] <= 1.10 * peaks[4], peaks
    # two worker processes, each writing every other shard: the same files, byte for byte (wall time said, not held:
    # on the 2-core CI VM the two processes' start-up is most of it)
    _, two = _export_peak_gib(tmp_path / "ckpt16", tmp_path / "out16_two", workers=2)
    one_files = sorted(p.name for p in (tmp_path / "out16").iterdir())
    assert one_files == sorted(p.name for p in (tmp_path / "out16_two").iterdir())
    assert all((tmp_path / "out16" / n).read_bytes() == (tmp_path / "out16_two" / n).read_bytes() for n in one_files)
    print(f"export-hf of 16 layers: {seconds[16]:.1f} s in one process, {two:.1f} s with --workers 2")
