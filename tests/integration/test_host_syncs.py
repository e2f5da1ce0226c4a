"""A training step that neither logs, evaluates, saves nor stops never reads a tensor on the host
(tests/workers/host_sync_worker.py counts every such read and the object/barrier collectives, per iteration, through
the recipe's real loop): the loss, its non-finite flags, the gradient norm and the MoE router scalars stay on the
device until a settling step reads them at once, and the ranks agree on signals only there.

Settling steps here (train_iters 7, log_interval 3): 1 (the first step, whose time the start-up line reports), 3 and 6
(logging) and 7 (the last, with its evaluation); 2, 4 and 5 must read nothing. An MoE model's dropless all-to-all is
megatron-core's: it reads each step's token counts to size its buffers (on a GPU on its own device-to-host stream,
waiting only for the router), so its reads are allowed there and nothing else is.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import ROOT, SMALL_MODEL, run_pretrain

SETTLING, QUIET = (1, 3, 6, 7), (2, 4, 5)
MEGATRON_MOE_DISPATCH = ("megatron/core/transformer/moe/", "megatron/core/tensor_parallel/mappings.py")

RUNS = {
    # dense, two pipeline stages, the distributed optimizer, gradient clipping (tiny.yaml's clip_grad 1.0)
    "dense-pp2": (ROOT / "configs" / "tiny.yaml",
                  [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
                   "parallel.sequence_parallel=false"]),
    # MoE at EP2 with aux-loss balancing: the router's loss is tracked every step
    "moe-ep2": (ROOT / "configs" / "tiny_moe.yaml",
                [*SMALL_MODEL, "model.num_layers=2", "parallel.pipeline_model_parallel_size=1",
                 "parallel.expert_model_parallel_size=2"]),
}


@pytest.mark.parametrize("name", RUNS)
def test_steps_that_do_not_settle_read_nothing_on_the_host(name, tmp_path):
    config, overrides = RUNS[name]
    run_pretrain(2, [*overrides, "train.train_iters=7", "logging.log_interval=3", "train.eval_interval=1000",
                     f"logging.log_dir={tmp_path / 'logs'}"],
                 module="tests.workers.host_sync_worker", config=config, env={"SYNC_COUNTS": str(tmp_path / "syncs")})
    for rank in range(2):
        seen = {int(it): calls for it, calls in json.loads((tmp_path / f"syncs.{rank}").read_text()).items()}
        for it in SETTLING:  # the counter sees the one read that settles (else this test could not fail)
            assert any("pending_steps.py" in call and " settle" in call for call in seen.get(it, [])), (it, seen)
        for it in QUIET:
            calls = seen.get(it, [])
            if name.startswith("moe"):
                calls = [call for call in calls if not any(path in call for path in MEGATRON_MOE_DISPATCH)]
            assert calls == [], f"rank {rank} read the device on iteration {it}, which does not settle: {calls}"
