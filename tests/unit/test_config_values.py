"""Config values are taken as written and never read the environment: overrides keep their whole value for string
keys, ``~`` is the home directory in both the recipe and overrides, and interpolations or shell variables are one
refusal that shows no secret."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from megatron_ext.config.schema import RecipeConfig, load_config
from megatron_ext.errors import ConfigError
from tests.launch import TINY


def test_a_string_override_keeps_its_whole_value_and_other_keys_are_typed():
    cfg = load_config(TINY, ["checkpoint.save=/mnt/exp #2/ckpt", "recipe.name=run: a, b", "checkpoint.load=null",
                             "train.train_iters=7", "data.blend=[a, b]", "train.compile=auto",
                             "model.attention_backend=local"])
    assert cfg.checkpoint.save == "/mnt/exp #2/ckpt" and cfg.recipe.name == "run: a, b"
    assert cfg.checkpoint.load is None and cfg.train.train_iters == 7 and cfg.data.blend == ["a", "b"]
    assert cfg.train.compile == "auto" and cfg.model.attention_backend == "local"
    with pytest.raises(ConfigError, match="expected one of"):
        load_config(TINY, ["model.attention_backend=bogus"])


def test_a_leading_tilde_is_the_home_directory_in_the_recipe_and_in_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("logging:\n  log_dir: ~/logs\n")
    cfg = load_config(recipe, ["checkpoint.save=~/ckpt", "recipe.name=~not-a-path"])
    assert cfg.checkpoint.save == str(Path.home() / "ckpt") and cfg.logging.log_dir == str(Path.home() / "logs")
    assert cfg.recipe.name == "~not-a-path"


def test_a_yaml_error_is_one_line_naming_the_file_and_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  train_iters: 3\ntrain:\n  micro_batch_size: 1\n")
    with pytest.raises(ConfigError) as error:
        load_config(recipe)
    assert str(error.value) == f"{recipe}:3: not valid YAML: found duplicate key train", error.value


@pytest.mark.parametrize("value", ["${oc.env:SECRET_TOKEN}", "/data/${oc.env:SECRET_TOKEN}/x", "$SECRET_TOKEN/x",
                                   "${recipe.name}"])
def test_the_environment_is_never_read_into_the_config(tmp_path, monkeypatch, value):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"logging:\n  wandb_run_name: '{value}'\n")
    for refused in (lambda: load_config(TINY, [f"checkpoint.save={value}"]), lambda: load_config(recipe)):
        with pytest.raises(ConfigError, match="never read the environment") as error:
            refused()
        assert "hunter2" not in str(error.value) and "\n" not in str(error.value)


def _keys(schema: type, prefix: str = ""):
    for f in dataclasses.fields(schema):
        hint = typing.get_type_hints(schema)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _keys(hint, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_no_config_key_holds_a_secret():
    """Configs are saved in every checkpoint and sent to W&B: a key for a token, key or password would need
    redaction there first (docs/security.md)."""
    secret_like = re.compile(r"(^|_)(token|api_?key|key|password|passwd|secret|credentials?)$")
    assert [k for k in _keys(RecipeConfig) if secret_like.search(k.split(".")[-1])] == []
