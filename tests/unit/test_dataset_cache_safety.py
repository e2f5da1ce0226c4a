"""No code runs from megatron-core's dataset index cache: its cached ``.npy`` indices are loaded with
``allow_pickle=True`` but memory-mapped (``mmap_mode="r"``), which numpy refuses for object arrays before
unpickling anything. A pickle payload planted at a cache path is an error, never code. megatron-core 0.19.2's loaders
(the calls this relies on) are hashed in tests/unit/test_upstream_patches.py."""

from __future__ import annotations

import os

import numpy
import pytest
from megatron.core.safe_globals import safe_numpy_load


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_pickled_payload_in_a_cached_index_is_refused_before_it_runs(tmp_path):
    planted = numpy.empty(1, dtype=object)
    planted[0] = _Payload(str(tmp_path / "ran"))
    index = tmp_path / "0123456789abcdef-GPTDataset-train-shuffle_index.npy"
    numpy.save(index, planted, allow_pickle=True)
    with pytest.raises(ValueError, match="Python objects"):
        safe_numpy_load(str(index), allow_pickle=True, mmap_mode="r")  # megatron-core 0.19.2's own call
    assert not (tmp_path / "ran").exists()
