"""Checkpoints in object storage: checkpoint.save names msc://PROFILE/prefix and storage.msc_config the
multi-storage-client profiles. Against a real S3-compatible server — moto's, started on localhost by the test, no
mock of the client — a DP2 run saving asynchronously into a bucket stops at 4, resumes from the bucket and stops at 6
exactly as the uninterrupted run, then continues in one process (DP 2 → 1, a resharded resume) within the parity
matrix's bounds; retention keeps the newest two in the bucket, the manifests are there, ``recipes.checkpoints`` lists
it, ``export-hf`` exports it (the same files as from a local copy) and ``recipes.generate`` writes the same text from
it as from that copy. A deleted object makes its checkpoint the corrupt
one it would be locally (set aside in the bucket, nothing deleted, the older one resumed), and a bucket the job
cannot write is one line before any rank starts."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from megatron_ext.checkpoint.layout import TRACKER
from recipes import convert, generate
from tests.conftest import parity_overrides
from tests.integration.test_parallel_parity import TOLERANCE
from tests.launch import (
    ROOT,
    SINGLE_PROCESS,
    max_relative_difference,
    read_scalars,
    run_env,
    run_pretrain,
    same_files,
)
from tests.object_store import msc_config, s3_client, s3_server

BUCKET, PROFILE = "checkpoints", "ckpt-on-s3"
DP2 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
       "parallel.sequence_parallel=false"]
RUN_NAME = "tiny-llama-tp2-pp2"  # configs/tiny.yaml's recipe.name
EIGHT = ["checkpoint.save_interval=2", "checkpoint.keep_last=2", "train.train_iters=8"]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """(endpoint, multi-storage-client configuration) of moto's server with an empty bucket."""
    with s3_server(BUCKET) as endpoint:
        yield endpoint, msc_config(tmp_path_factory.mktemp("msc") / "msc.yaml", endpoint, {PROFILE: BUCKET})


def _keys(endpoint: str, prefix: str) -> list[str]:
    listed = s3_client(endpoint).list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(entry["Key"][len(prefix):] for entry in listed.get("Contents", []))


def _generated(checkpoint: str, *options: str) -> str:
    """What recipes.generate prints for the checkpoint (its greedy text)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = generate.main(["--checkpoint", checkpoint, *options, "--prompt", "def", "--max-new-tokens", "8"])
    assert code == 0
    return printed.getvalue()


def test_a_run_saves_to_a_bucket_and_resumes_from_it_exactly_and_resharded(bucket, initial_weights, megatron,
                                                                            tmp_path):
    endpoint, config = bucket
    remote = [f"checkpoint.save=msc://{PROFILE}/run", f"storage.msc_config={config}", "checkpoint.async_save=true"]
    run_pretrain(2, [*parity_overrides(initial_weights, tmp_path / "whole"), *DP2, *EIGHT])
    run_pretrain(2, [*parity_overrides(initial_weights, tmp_path / "first"), *DP2, *EIGHT, *remote,
                     "train.exit_interval=4"])
    assert {key.split("/")[0] for key in _keys(endpoint, "run/")} >= {"iter_0000002", "iter_0000004"}
    # the same objects named by their S3 URL, which the configuration's path_mapping maps to the profile
    as_s3 = [f"checkpoint.save=s3://{BUCKET}/run", *remote[1:]]
    proc = run_pretrain(2, [*parity_overrides(None, tmp_path / "exact"), *DP2, *EIGHT, *as_s3, "train.exit_interval=6"])
    assert f"resumed from s3://{BUCKET}/run at iteration 4" in proc.stdout, proc.stdout[-3000:]
    whole = {tag: read_scalars(tmp_path / "whole", tag) for tag in TOLERANCE}
    for tag in TOLERANCE:  # the same world resumes onto the uninterrupted run's losses, bit for bit
        resumed = read_scalars(tmp_path / "exact", tag)
        assert sorted(resumed) == [5, 6] and resumed == {step: whole[tag][step] for step in (5, 6)}, tag
    proc = run_pretrain(1, [*parity_overrides(None, tmp_path / "resharded"), *SINGLE_PROCESS, *EIGHT, *remote])
    assert f"resumed from msc://{PROFILE}/run at iteration 6" in proc.stdout, proc.stdout[-3000:]
    for tag, bound in TOLERANCE.items():
        resharded = read_scalars(tmp_path / "resharded", tag)
        assert sorted(resharded) == [7, 8], resharded
        assert max_relative_difference({step: whole[tag][step] for step in (7, 8)}, resharded) <= bound, tag
    keys = _keys(endpoint, "run/")
    assert {key.split("/")[0] for key in keys} == {"iter_0000006", "iter_0000008", "latest_checkpointed_iteration.txt",
                                                   "progress.json", "goodput.json"}, keys  # retention: the newest 2
    assert {"iter_0000006/manifest.json", "iter_0000008/manifest.json"} <= set(keys)
    listed = subprocess.run([sys.executable, "-m", "recipes.checkpoints", f"msc://{PROFILE}/run", "--verify",
                             "--msc-config", str(config)], cwd=ROOT, env=run_env({}), capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "iter_0000008" in listed.stdout and "complete, verified" in listed.stdout and "<- tracker" in listed.stdout

    # export-hf reads the bucket's checkpoint (two workers): the same files as from a local copy of it
    local = tmp_path / "downloaded"
    for key in [TRACKER, *(k for k in keys if k.startswith("iter_0000008/"))]:
        (local / key).parent.mkdir(parents=True, exist_ok=True)
        s3_client(endpoint).download_file(BUCKET, f"run/{key}", str(local / key))
    code = megatron(convert.main, ["export-hf", "--checkpoint", f"msc://{PROFILE}/run", "--msc-config", str(config),
                                   "--output", str(tmp_path / "from_bucket"), "--workers", "2"])
    assert code == 0
    megatron(convert.export_hf, local, tmp_path / "from_disk")
    assert same_files(tmp_path / "from_bucket", tmp_path / "from_disk")
    from_bucket = megatron(_generated, f"s3://{BUCKET}/run", "--msc-config", str(config))
    assert from_bucket == megatron(_generated, str(local)) and from_bucket.startswith("--- 'def'\ndef"), from_bucket

    # the launcher reads the bucket before any rank starts: the run is complete
    done = run_pretrain(1, [*parity_overrides(None, tmp_path / "done"), *SINGLE_PROCESS, *EIGHT, *remote],
                        launcher="recipes.launch")
    assert done.stdout.startswith(f"run {RUN_NAME} is complete: msc://{PROFILE}/run holds iteration 8"), done.stdout

    # a deleted object: the newest checkpoint is set aside in the bucket, the older one resumed
    s3_client(endpoint).delete_object(Bucket=BUCKET, Key=f"run/{next(k for k in keys if k.startswith('iter_0000008/__'))}")
    proc = run_pretrain(1, [*parity_overrides(None, tmp_path / "fallback", steps=8), *SINGLE_PROCESS, *EIGHT, *remote],
                        check=False)
    assert "CHECKPOINT NOT USABLE" in proc.stdout + proc.stderr and proc.returncode == 0, proc.stdout[-3000:]
    keys = _keys(endpoint, "run/")
    assert any(key.startswith("iter_0000008.corrupt/") for key in keys), keys


def test_a_bucket_the_job_cannot_write_is_one_line_before_any_rank_starts(bucket, tmp_path):
    _, config = bucket
    missing = msc_config(tmp_path / "msc.yaml", bucket[0], {"nowhere": "no-such-bucket"})
    proc = run_pretrain(2, [*parity_overrides(None, tmp_path / "tb"), *DP2, "checkpoint.save=msc://nowhere/run",
                            f"storage.msc_config={missing}"], check=False, launcher="recipes.launch")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("checkpoint.save=msc://nowhere/run is invalid: multi-storage-client cannot write it with "
            f"storage.msc_config={missing}") in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "[rank" not in proc.stdout, proc.stdout[-2000:]
