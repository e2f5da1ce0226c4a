"""What a config value may be, wherever it comes from (the YAML recipe or a ``section.key=value`` override).

* An override is a value, not a YAML document: for a string key (a path, a name) everything after the first ``=``
  is the value, spaces, ``#`` and ``:`` included (``checkpoint.save=/mnt/exp #2/ckpt`` stays whole); ``null`` is
  None. Numbers, booleans and lists are typed as YAML types them (``train.train_iters=1e3`` is refused, ``[a, b]``
  is a list).
* Nothing is read from the environment: OmegaConf interpolations (``${oc.env:HF_TOKEN}``, ``${other.key}``) and
  shell variables (``$HOME``) in a value are refused in one line, so no secret can be resolved into the config a
  checkpoint, W&B or a resume diff carries (docs/security.md). ``~`` at the start of a value is the user's home,
  as the shell would make it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Literal, Optional, Union, get_args, get_origin

from omegaconf import DictConfig, ListConfig, OmegaConf

from megatron_ext.errors import ConfigError

_SHELL_VARIABLE = re.compile(r"\$(\{|[A-Za-z_])")


def _string_typed(annotation: Any) -> bool:
    """The key takes a string as written: ``str``, ``Optional[str]`` or a Literal of strings only."""
    if annotation is str:
        return True
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Union:
        return all(_string_typed(a) or a is type(None) for a in args) and any(_string_typed(a) for a in args)
    return origin is Literal and all(isinstance(a, str) for a in args)


def _declared_type(schema: type, dotted_key: str) -> Optional[Any]:
    """The annotation of `dotted_key` in the dataclass `schema`, None when there is no such key."""
    owner: Any = schema
    annotation = None
    for part in dotted_key.split("."):
        if not dataclasses.is_dataclass(owner):
            return None
        hints = typing.get_type_hints(owner)
        if part not in hints:
            return None
        annotation = owner = hints[part]
    return annotation


def override_as_config(schema: type, item: str) -> DictConfig:
    """One ``section.key=value`` override as a config to merge: string keys keep the value as written."""
    key, value = item.split("=", 1)
    if _string_typed(_declared_type(schema, key)):
        refuse_environment(key, value)
        return OmegaConf.create(_nested(key, None if value == "null" else value))
    return OmegaConf.from_dotlist([item])


def _nested(dotted_key: str, value: Any) -> dict[str, Any]:
    for part in reversed(dotted_key.split(".")):
        value = {part: value}
    return value


def refuse_environment(key: str, value: str) -> None:
    if "${" in value or _SHELL_VARIABLE.search(value):
        raise ConfigError(
            f"{key}={value!r}: values are taken as written and never read the environment (no ${{...}} "
            "interpolation, no $VARIABLE): write the value itself, or let your shell expand it unquoted; secrets "
            "(HF_TOKEN, WANDB_API_KEY) stay in the environment, where the libraries read them")


def checked_values(config: DictConfig) -> None:
    """Refuse interpolations and shell variables in every string value of the loaded config, and expand a leading
    ``~`` (in place, before the config is resolved)."""
    for key, node, parent, slot in _leaves(config, ""):
        value = node._value()  # an interpolation's own text, unresolved
        if isinstance(value, str):
            refuse_environment(key, value)
            if value == "~" or value.startswith("~/"):
                parent[slot] = os.path.expanduser(value)


def _leaves(container: Union[DictConfig, ListConfig], prefix: str):
    slots = container.keys() if isinstance(container, DictConfig) else range(len(container))
    for slot in slots:
        node = container._get_node(slot)
        if isinstance(container, DictConfig):
            key = f"{prefix}.{slot}" if prefix else str(slot)
        else:
            key = f"{prefix}[{slot}]"
        if isinstance(node, (DictConfig, ListConfig)) and not OmegaConf.is_interpolation(container, slot):
            if not node._is_none():
                yield from _leaves(node, key)
        else:
            yield key, node, container, slot
