"""Subprocess worker: forward and backward through torch.compile'd decoder layers (CPU, world of one).

Prints one JSON line: dynamo's graph-break count and what the compiled calls wrote to stderr (file
descriptor 2, which also catches dynamo's own log handlers), with every Python warning shown.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import torch
from torch._dynamo.utils import counters

from megatron_ext.config.schema import load_config
from megatron_ext.distributed import cpu_backend
from megatron_ext.distributed.parallel import destroy_distributed, init_distributed
from megatron_ext.model.llama import build_model_chunks, compile_layers, transformer_config

if __name__ == "__main__":
    on_gpu = not cpu_backend.install()
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                             "model.num_query_groups=2", "model.seq_length=32", "model.vocab_size=128",
                             "model.attention_backend=local", "train.compile=true"])
    init_distributed(cfg, on_gpu)
    try:
        model = build_model_chunks(cfg, 128, transformer_config(cfg, on_gpu, use_te=False), use_te=False)[0]
        if on_gpu:
            model = model.cuda()
            torch.set_float32_matmul_precision("high")  # else inductor warns about unused TF32 cores
        compile_layers([model])
        device = next(model.parameters()).device
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
        positions = torch.arange(32, device=device).expand(2, 32)
        warnings.simplefilter("always")  # megatron-core's DeprecationWarnings are hidden by default
        with tempfile.TemporaryFile() as capture:
            stderr_fd = os.dup(2)
            os.dup2(capture.fileno(), 2)
            try:
                for _ in range(2):  # the second call reuses the compiled graphs
                    model(tokens, positions, attention_mask=None, labels=tokens).sum().backward()
            finally:
                sys.stderr.flush()
                os.dup2(stderr_fd, 2)
            capture.seek(0)
            stderr = capture.read().decode(errors="replace")
        print(json.dumps({"graph_breaks": sum(counters["graph_break"].values()),
                          "compiled_graphs": counters["stats"]["unique_graphs"], "stderr": stderr}))
    finally:
        destroy_distributed()
