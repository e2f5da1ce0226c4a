"""A real S3-compatible server for the object-storage tests: moto's, started on a free localhost port (no mock of
the client), and multi-storage-client configurations whose profiles are its buckets."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

KEYS = {"aws_access_key_id": "test", "aws_secret_access_key": "test"}


@contextmanager
def s3_server(*buckets: str) -> Iterator[str]:
    """moto's S3 server with `buckets` created; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for bucket in buckets:
        s3_client(endpoint).create_bucket(Bucket=bucket)
    try:
        yield endpoint
    finally:
        server.stop()


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **KEYS)


def msc_config(path: Path, endpoint: str, profiles: dict[str, str]) -> Path:
    """A multi-storage-client configuration at `path` with one profile per {profile: bucket} of the server, each
    bucket's s3:// URLs mapped to its profile."""
    text = "profiles:\n" + "".join(f"""  {profile}:
    storage_provider:
      type: s3
      options: {{base_path: {bucket}, endpoint_url: "{endpoint}", region_name: us-east-1}}
    credentials_provider:
      type: S3Credentials
      options: {{access_key: test, secret_key: test}}
""" for profile, bucket in profiles.items()) + "path_mapping:\n" + "".join(
        f"  s3://{bucket}/: msc://{profile}/\n" for profile, bucket in profiles.items())
    path.write_text(text)
    return path
