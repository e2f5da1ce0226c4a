"""The data skips kept beside a run's checkpoints: where the training data goes on after an iteration, chained and
replaced as rewinds add them, written atomically, and a malformed file refused in one line naming it (one process,
gloo)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from megatron_ext.checkpoint.data_skips import DataSkip, DataSkips
from megatron_ext.checkpoint.layout import DATA_SKIPS
from megatron_ext.errors import CheckpointError


@pytest.fixture()
def one_process():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_data_goes_on_past_the_skips_recorded_for_an_iteration_and_its_position(one_process, tmp_path):
    skips = DataSkips(tmp_path)
    assert skips.position(4, 32) == (32, [])  # nothing recorded: the data goes on where it is
    skips.add(DataSkip(4, 32, 48, "first"))
    assert skips.position(4, 32) == (48, [DataSkip(4, 32, 48, "first")])
    assert skips.position(4, 40)[0] == 40 and skips.position(5, 32)[0] == 32  # another iteration or position
    skips.add(DataSkip(4, 48, 56, "chained"))  # from where the first one lands
    assert skips.position(4, 32)[0] == 56
    skips.add(DataSkip(4, 32, 64, "a second rewind to the same checkpoint"))  # replaces the first
    assert [s.reason for s in DataSkips(tmp_path).entries] == ["chained", "a second rewind to the same checkpoint"]
    assert DataSkips(tmp_path).position(4, 32)[0] == 64
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename
    assert DataSkips(None).position(4, 32) == (32, [])  # a run that saves nothing keeps none


@pytest.mark.parametrize("content, fragment", [
    ("{", "not readable as JSON"),
    ('{"iteration": 4}', "expected a list of data skips"),
    ('[{"iteration": 4, "from_sample": 48, "to_sample": 32}]', "entry 0"),
    ('[{"iteration": 4, "from_sample": 32, "to_sample": 48}, {"iteration": -1, "from_sample": 0, "to_sample": 8}]',
     "entry 1"),
    ('[{"iteration": 4, "from_sample": 32, "to_sample": 48.5}]', "entry 0"),
    ('[{"iteration": true, "from_sample": 32, "to_sample": 48}]', "entry 0"),
    ('[{"iteration": 4, "from_sample": 32, "to_sample": 48, "samples": 3}]', "entry 0"),
])
def test_a_malformed_file_is_one_line_naming_it(tmp_path, content, fragment):
    (tmp_path / DATA_SKIPS).write_text(content)
    with pytest.raises(CheckpointError) as err:
        DataSkips(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / DATA_SKIPS}: ") and fragment in message and "\n" not in message
    assert message.endswith("correct or delete it")


def test_an_entry_written_by_hand_is_read(tmp_path):
    (tmp_path / DATA_SKIPS).write_text(json.dumps([{"iteration": 0, "from_sample": 0, "to_sample": 16}]))
    assert DataSkips(tmp_path).position(0, 0) == (16, [DataSkip(0, 0, 16)])
