"""The small corpora the data tests share (unit and integration alike); tests/conftest.py builds them, and the
tokenizers trained on them, once per session."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["def", "return", "self", "value", "data", "for", "in", "if", "else", "import", "class", "print"]
# Unicode-heavy documents for the byte-level BPE; one empty (the post-processor's BOS alone, then EOD, as
# Megatron-LM writes it)
UNICODE_TEXTS = [f"def f{i}(x):\n    return x * {i}  # Café naïve, ünïcode ✓\n" * (1 + i % 4) for i in range(60)]
UNICODE_TEXTS[7] = ""
UNICODE_TEXTS[11] = " \t\n "  # whitespace only: tokens, but no words

# One bad JSONL input per kind of problem, and what the error names
BAD_LINES = {
    "malformed_json": (b'{"text": "ok"}\n{"text": "oops\n', "2: malformed JSON"),
    "missing_key": (b'{"text": "ok"}\n{"txt": "oops"}\n', "2: missing key 'text'"),
    "non_string": (b'{"text": "ok"}\n\n{"text": ["a", "b"]}\n', "3: key 'text' is list"),
    "invalid_utf8": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "2: invalid UTF-8"),
    "empty_file": (b"", ": no documents (file is empty)"),
}


def code_docs(n: int) -> list[str]:
    """Varied but deterministic Python-ish text over a small alphabet, so a ~300 piece vocab fits."""
    docs = []
    for i in range(n):
        lines = [f"def f{i}_{j}(x):\n    return {WORDS[(i + j) % len(WORDS)]} + {i * j}\n"
                 for j in range(1 + i % 5)]
        docs.append("".join(lines))
    return docs


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path
