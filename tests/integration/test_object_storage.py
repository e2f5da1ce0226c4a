"""Token data in object storage: data.blend names msc://PROFILE/prefix (or s3://BUCKET/prefix, which the
configuration maps to a profile) and storage.msc_config multi-storage-client's profiles; megatron-core's
object-storage datasets read it (the index downloaded once into storage.cache, the tokens in byte ranges). Against a
real S3-compatible server — moto's, started on localhost by the test, no mock of the client — a DP2 run reads the same
samples as the single-process run on the local copy of the data (the parity matrix's bounds), and a missing object or
an unknown profile is one line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import PARITY_STEPS, parity_overrides
from tests.integration.test_parallel_parity import TOLERANCE
from tests.launch import ROOT, max_relative_difference, read_scalars, run_pretrain
from tests.object_store import msc_config as write_msc_config
from tests.object_store import s3_client, s3_server

DATA = ROOT / "data" / "tiny" / "stdlib_text_document"  # the default blend, which the parity runs read
BUCKET, PROFILE = "tokens", "tokens-on-s3"
AS_S3 = f"s3://{BUCKET}/tiny/stdlib_text_document"
DP2 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
       "parallel.sequence_parallel=false"]


@pytest.fixture(scope="module")
def msc_config(tmp_path_factory) -> Path:
    """moto's S3 server with the default dataset uploaded, and a multi-storage-client configuration whose profile is
    that bucket."""
    with s3_server(BUCKET) as endpoint:
        for suffix in (".bin", ".idx"):
            s3_client(endpoint).upload_file(f"{DATA}{suffix}", BUCKET, f"tiny/stdlib_text_document{suffix}")
        yield write_msc_config(tmp_path_factory.mktemp("msc") / "msc.yaml", endpoint, {PROFILE: BUCKET})


def test_a_dp2_run_reads_object_storage_as_one_process_reads_the_local_data(msc_config, initial_weights,
                                                                            single_process_reference, tmp_path):
    cache = tmp_path / "cache"
    # named by its S3 URL: the configuration's path_mapping makes it the profile's (megatron-core reads it through
    # multi-storage-client, not with its own boto3 reader)
    run_pretrain(2, [*parity_overrides(initial_weights, tmp_path / "tb"), *DP2, f"data.blend=[{AS_S3}]",
                     f"storage.msc_config={msc_config}", f"storage.cache={cache}"])
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.datasets import max_token_id

    index = cache / PROFILE / "tiny" / "stdlib_text_document.idx"
    assert index.read_bytes() == Path(f"{DATA}.idx").read_bytes()
    # the token-id check's pass over the objects, remembered beside the index: the local data's largest id
    remembered = json.loads(index.with_suffix(".max_token_id.json").read_text())["max_token_id"]
    assert remembered == max_token_id(IndexedDataset(str(DATA)))
    for tag, tolerance in TOLERANCE.items():
        measured, reference = read_scalars(tmp_path / "tb", tag), read_scalars(single_process_reference, tag)
        diff = max_relative_difference(measured, reference)
        print(f"object storage dp2 {tag}: max rel diff {diff:.2e}")
        assert len(measured) == PARITY_STEPS and diff <= tolerance, (tag, measured, reference)


@pytest.mark.parametrize("blend, expected", [
    (f"msc://{PROFILE}/tiny/missing", f"data.blend=msc://{PROFILE}/tiny/missing is invalid: "
                                      f"msc://{PROFILE}/tiny/missing.bin does not exist in object storage"),
    ("msc://no-such-profile/tiny/stdlib_text_document", "multi-storage-client cannot read "
                                                        "msc://no-such-profile/tiny/stdlib_text_document.bin"),
], ids=["missing_object", "unknown_profile"])
def test_what_object_storage_lacks_is_one_line_before_any_rank_starts(msc_config, blend, expected, tmp_path):
    proc = run_pretrain(2, [*parity_overrides(None, tmp_path / "tb"), *DP2, f"data.blend=[{blend}]",
                            f"storage.msc_config={msc_config}", f"storage.cache={tmp_path / 'cache'}"], check=False,
                        launcher="recipes.launch")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "[rank" not in proc.stdout, proc.stdout[-2000:]
