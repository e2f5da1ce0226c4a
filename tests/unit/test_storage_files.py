"""megatron_ext/storage/files.py: each file operation a checkpoint directory needs, the same on a local file system and
in object storage (moto's S3 server on localhost, no mock of the client)."""

from __future__ import annotations

import os
import time

import pytest

from megatron_ext.checkpoint import layout
from megatron_ext.errors import ConfigError
from megatron_ext.storage import files
from tests.object_store import msc_config, s3_server


@pytest.fixture(scope="module")
def remote_root(tmp_path_factory):
    with s3_server("runs") as endpoint:
        files.enable(msc_config(tmp_path_factory.mktemp("msc") / "msc.yaml", endpoint, {"runs": "runs"}))
        yield "msc://runs/run"


@pytest.fixture(params=["local", "object storage"])
def root(request, tmp_path, remote_root):
    return str(tmp_path / "run") if request.param == "local" else f"{remote_root}/{tmp_path.name}"


def test_a_checkpoint_directory_is_listed_replaced_set_aside_and_removed_alike(root):
    base = files.at(root)
    base.mkdir(parents=True, exist_ok=True)
    for iteration in (2, 4):
        (layout.iteration_dir(root, iteration) / "shards").mkdir(parents=True, exist_ok=True)
        (layout.iteration_dir(root, iteration) / "shards" / "__0_0.distcp").write_bytes(b"x" * iteration)
        (layout.iteration_dir(root, iteration) / layout.MANIFEST).write_text("{}")
    layout.write_tracker(root, 4)
    layout.write_tracker(root, 2)  # replaced whole
    assert layout.latest_iteration(root) == 2 and layout.complete_iterations(root) == [2, 4]
    assert sorted(str(p.relative_to(layout.iteration_dir(root, 4))) for p in layout.iteration_dir(root, 4).rglob("*")
                  if p.is_file()) == [layout.MANIFEST, "shards/__0_0.distcp"]
    aside = layout.set_aside(layout.iteration_dir(root, 4))
    assert [(d.iteration, d.set_aside) for d in layout.iteration_dirs(root)] == [(2, False), (4, True)]
    assert (aside / "shards" / "__0_0.distcp").read_bytes() == b"x" * 4  # nothing lost
    files.remove_tree(aside)
    files.remove_tree(layout.iteration_dir(root, 6))  # absent: nothing to do
    assert [d.iteration for d in layout.iteration_dirs(root)] == [2] and not aside.is_dir()


def test_of_two_creators_one_wins_and_a_refresh_moves_the_time_only(root):
    files.at(root).mkdir(parents=True, exist_ok=True)
    lock = files.at(root) / layout.RUN_LOCK
    assert files.create_exclusively(lock, "first") and not files.create_exclusively(lock, "second")
    assert lock.read_text() == "first"
    before = lock.stat().st_mtime
    time.sleep(1.1)  # S3 keeps modification times to the second
    files.refresh(lock)
    assert lock.stat().st_mtime > before and lock.read_text() == "first"
    lock.unlink()
    assert files.create_exclusively(lock, "second") and lock.read_text() == "second"


def test_a_command_given_a_bucket_needs_the_configuration_that_names_it(remote_root, tmp_path):
    files.enable_named(str(tmp_path), None)  # a local directory needs none
    with pytest.raises(ConfigError, match=r"^msc://p/run is in object storage: name multi-storage-client's "
                                          r"configuration with --msc-config \(the run's storage.msc_config\)$"):
        files.enable_named("msc://p/run", None)
    with pytest.raises(ConfigError, match=r"^--msc-config='/nowhere.yaml' is invalid: does not exist$"):
        files.enable_named("msc://p/run", "/nowhere.yaml")
    config = os.environ[files.MSC_CONFIG_ENV]  # the module's server's
    with pytest.raises(ConfigError, match=rf"^msc://p/run: multi-storage-client cannot resolve it with "
                                          rf"--msc-config={config}: Profile \"p\" not found"):
        files.enable_named("msc://p/run", config)
    files.enable_named(remote_root, config)


def test_an_s3_url_is_the_profile_its_configuration_maps_it_to(remote_root):
    assert files.msc_url("s3://runs/run/iter_0000002") == "msc://runs/run/iter_0000002"
    assert files.msc_url("/local/run") == "/local/run" and files.msc_url(remote_root) == remote_root
