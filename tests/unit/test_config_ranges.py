"""Every numeric key has a range, checked when the config loads: a random value outside it, for any key, is one
ConfigError naming the key (hypothesis feeds them); values inside pass."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from megatron_ext.config.ranges import RANGES, Range
from megatron_ext.config.schema import RecipeConfig, load_config
from megatron_ext.errors import ConfigError
from tests.launch import TINY, session_temp_dir


def _numeric_keys(schema: type = RecipeConfig, prefix: str = ""):
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _numeric_keys(hint, f"{prefix}{f.name}.")
            continue
        args = set(typing.get_args(hint)) | {hint} | {a for x in typing.get_args(hint) for a in typing.get_args(x)}
        if typing.get_origin(hint) is not typing.Literal and args & {int, float}:
            yield prefix + f.name, float in args


NUMERIC = dict(_numeric_keys())
set_hypothesis_home_dir(session_temp_dir("hypothesis-"))  # its caches stay out of the repository


def test_every_numeric_key_has_a_range():
    assert sorted(set(NUMERIC) - set(RANGES)) == [] and sorted(set(RANGES) - set(NUMERIC)) == []


def _outside(allowed: Range, is_float: bool) -> st.SearchStrategy:
    below_low = allowed.low if allowed.low_open else allowed.low - (1e-9 if is_float else 1)
    below = (st.floats(max_value=below_low, allow_nan=False, allow_infinity=False) if is_float
             else st.integers(max_value=int(math.floor(below_low))))
    if allowed.high == math.inf:
        return below
    above_high = allowed.high if allowed.high_open else allowed.high + 1e-9
    return below | st.floats(min_value=above_high, allow_nan=False, allow_infinity=False, max_value=1e12)


@settings(max_examples=300, deadline=None, database=None)  # no example database in the tree
@given(st.data())
def test_a_value_out_of_range_is_one_line_naming_the_key(data):
    key = data.draw(st.sampled_from(sorted(NUMERIC)))
    value = data.draw(_outside(RANGES[key], NUMERIC[key]))
    listed = key.startswith("logging.profile_") or key == "model.window_size"  # keys that take only a list
    override = f"{key}=[{value!r}]" if listed else f"{key}={value!r}"
    with pytest.raises(ConfigError) as error:
        load_config(TINY, [override])
    assert str(error.value).startswith(key) and "\n" not in str(error.value), error.value


@pytest.mark.parametrize("override, fragment", [
    ("model.ffn_hidden_size=-256", "model.ffn_hidden_size=-256 is invalid: must be >= 1"),
    ("model.make_vocab_size_divisible_by=0", "must be >= 1"),
    ("optimizer.adam_beta1=5", "optimizer.adam_beta1=5.0 is invalid: must be in [0, 1)"),
    ("data.num_workers=-3", "must be >= 0"),
    ("parallel.distributed_timeout_minutes=0", "must be >= 1"),
    ("model.kv_channels=-32", "must be >= 1"),
])
def test_the_issues_examples_are_refused(override, fragment):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, [override])
    assert fragment in str(error.value), error.value


def test_boundaries_inside_the_range_pass():
    load_config(TINY, ["train.train_iters=0", "model.hidden_dropout=0", "optimizer.optimizer_offload_fraction=1",
                       "train.hang_timeout_s=null", "parallel.distributed_timeout_minutes=1"])
