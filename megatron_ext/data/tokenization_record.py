"""How a dataset was tokenized, recorded beside it: ``PREFIX.tokenization.json``, written by data_prep.preprocess.

Megatron-LM's tools/preprocess_data.py has three conventions for a Hugging Face tokenizer, chosen by its flags (the
same names here): by default (megatron.core.tokenizers) no special tokens, so a Llama-3-style byte-level BPE writes
no begin-of-text token and nothing for an empty document; ``--tokenizer-hf-include-special-tokens`` and
``--legacy-tokenizer`` add what the tokenizer's post-processor adds (Llama 3: BOS on every document). A blend that
mixes them trains on two conventions at once, which nothing else would tell: :func:`mixed_conventions` says so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal, Optional

RECORD_SUFFIX = ".tokenization.json"
# Megatron-LM's flags: none, --tokenizer-hf-include-special-tokens, --legacy-tokenizer
Convention = Literal["default", "include-special-tokens", "legacy"]


@dataclasses.dataclass(frozen=True)
class TokenizationRecord:
    tokenizer_type: str
    tokenizer: str
    convention: Convention
    append_eod: bool
    begins_with_bos: bool  # every non-empty document starts with the tokenizer's BOS

    def describe(self) -> str:
        flag = {"default": "Megatron-LM's default, no special tokens",
                "include-special-tokens": "--tokenizer-hf-include-special-tokens",
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
        return TokenizationRecord(**json.loads(record_path(prefix).read_text()))
    except (OSError, ValueError, TypeError):
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
            + " but not in " + ", ".join(by_bos[False]) + " (data_prep.preprocess --legacy-tokenizer or "
            "--tokenizer-hf-include-special-tokens against Megatron-LM's default): preprocess them the same way")
