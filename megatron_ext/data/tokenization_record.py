"""How a dataset was tokenized, recorded beside it: ``PREFIX.tokenization.json``, written by data_prep.preprocess.

Megatron-LM's tools/preprocess_data.py has three conventions for a Hugging Face tokenizer, chosen by its flags (the
same names here): by default (megatron.core.tokenizers, since Megatron-LM 0.17) and with ``--legacy-tokenizer``, what
the tokenizer's post-processor adds (Llama 3: BOS on every document); with ``--tokenizer-hf-no-include-special-tokens``
(Megatron-LM 0.16's default) no special tokens, so a Llama-3-style byte-level BPE writes no begin-of-text token and
nothing for an empty document. A blend that mixes them trains on two conventions at once, which nothing else would
tell: :func:`mixed_conventions` says so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal, Optional

RECORD_SUFFIX = ".tokenization.json"
# Megatron-LM's flags: none, --tokenizer-hf-no-include-special-tokens, --legacy-tokenizer
Convention = Literal["include-special-tokens", "no-include-special-tokens", "legacy"]
DEFAULT_CONVENTION: Convention = "include-special-tokens"
# a record's convention as data_prep wrote it before it followed Megatron-LM 0.17's default: no special tokens
_RENAMED = {"default": "no-include-special-tokens"}


def includes_special_tokens(convention: Convention) -> bool:
    """Whether a Hugging Face tokenizer adds what its post-processor adds under `convention`."""
    return convention != "no-include-special-tokens"


@dataclasses.dataclass(frozen=True)
class TokenizationRecord:
    tokenizer_type: str
    tokenizer: str
    convention: Convention
    append_eod: bool
    begins_with_bos: bool  # every non-empty document starts with the tokenizer's BOS

    def describe(self) -> str:
        flag = {"include-special-tokens": "Megatron-LM's default, with special tokens",
                "no-include-special-tokens": "--tokenizer-hf-no-include-special-tokens",
                "legacy": "--legacy-tokenizer"}[self.convention]
        return (f"{self.tokenizer_type} ({flag}), {'EOD appended' if self.append_eod else 'no EOD'}; documents "
                f"{'begin' if self.begins_with_bos else 'do not begin'} with BOS")


def record_path(prefix: str) -> Path:
    return Path(prefix + RECORD_SUFFIX)


def write_record(path: Path, record: TokenizationRecord) -> None:
    path.write_text(json.dumps(dataclasses.asdict(record), indent=1) + "\n")


def read_record(prefix: str) -> Optional[TokenizationRecord]:
    """The record beside `prefix` (None: written by another tool, or by an older data_prep)."""
    try:
        fields = json.loads(record_path(prefix).read_text())
        fields["convention"] = _RENAMED.get(fields.get("convention"), fields.get("convention"))
        return TokenizationRecord(**fields)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def describe_blend(prefixes: list[str]) -> Optional[str]:
    """The start-up line saying how the blend's datasets were tokenized (None when none has a record)."""
    records = {prefix: read_record(prefix) for prefix in prefixes}
    known = {record.describe() for record in records.values() if record is not None}
    if not known:
        return None
    unknown = sum(record is None for record in records.values())
    return ("data: tokenized " + "; ".join(sorted(known))
            + (f" ({unknown} of {len(records)} datasets without a record)" if unknown else ""))


def mixed_conventions(prefixes: list[str]) -> Optional[str]:
    """One warning naming the datasets of each BOS convention when a blend mixes them (None when it does not)."""
    by_bos: dict[bool, list[str]] = {}
    for prefix in prefixes:
        record = read_record(prefix)
        if record is not None:
            by_bos.setdefault(record.begins_with_bos, []).append(prefix)
    if len(by_bos) < 2:
        return None
    return ("the blend mixes tokenization conventions: documents begin with BOS in " + ", ".join(by_bos[True])
            + " but not in " + ", ".join(by_bos[False]) + " (data_prep.preprocess --tokenizer-hf-no-include-special-"
            "tokens, or data prepared by Megatron-LM 0.16 or earlier, against the default): preprocess them the same "
            "way")
