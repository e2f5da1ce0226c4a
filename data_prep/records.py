"""Streaming reader of input documents (.jsonl, .jsonl.gz, .txt, .parquet) with strict validation."""

import glob
import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, NamedTuple

from megatron_ext.errors import BadRecordError

MAX_REPORTED_LOCATIONS = 5
# One record (a jsonl line, a .txt file) larger than this is a broken file, or a whole corpus on one line: refused
# before it is read whole (a multi-GB line, or a gzip bomb decompressing into one, would exhaust the host's memory).
MAX_RECORD_BYTES = 256 << 20


class Document(NamedTuple):
    path: str
    line: int  # 1-based line (jsonl), row (parquet) or 1 (txt)
    fields: dict[str, str]


@dataclass
class SkippedRecords:
    """Bad records skipped under --skip-bad-records, for the CLI summary."""

    count: int = 0
    first: list[str] = field(default_factory=list)  # `file:line: why` of the first few

    def add(self, err: BadRecordError) -> None:
        self.count += 1
        if len(self.first) < MAX_REPORTED_LOCATIONS:
            self.first.append(str(err))

    def summary(self) -> str:
        if not self.count:
            return "0"
        more = ", ..." if self.count > len(self.first) else ""
        return f"{self.count} (first: {'; '.join(self.first)}{more})"


def _readable_stream(path: str) -> bool:
    """A file, or a pipe such as `--input <(zstdcat corpus.jsonl.zst)` (/dev/fd/N) or a FIFO."""
    return os.path.exists(path) and not os.path.isdir(path)


def expand_inputs(paths_or_globs: list[str]) -> list[str]:
    """Expand each pattern (sorted, so the order never depends on the file system); keep given order."""
    files = []
    for pattern in paths_or_globs:
        if _readable_stream(pattern):  # a literal name may contain glob metacharacters like "["
            matches = [pattern]
        else:
            matches = [m for m in sorted(glob.glob(pattern, recursive=True)) if _readable_stream(m)]
        if not matches:
            raise BadRecordError(f"{pattern}: no input file matches")
        files.extend(matches)
    return files


def iter_documents(
    paths_or_globs: list[str],
    json_keys: list[str],
    skip_bad_records: bool,
    skipped: SkippedRecords | None = None,
) -> Iterator[Document]:
    """Yield every document of every input in order; bad records raise or, if asked, land in `skipped`."""
    skipped = skipped if skipped is not None else SkippedRecords()
    for path in expand_inputs(paths_or_globs):
        n_docs = 0
        skipped_before = skipped.count
        for doc in _iter_file(path, json_keys, skip_bad_records, skipped):
            n_docs += 1
            yield doc
        if n_docs == 0:
            n_bad = skipped.count - skipped_before
            why = f"all {n_bad} records were bad and skipped" if n_bad else "file is empty"
            raise BadRecordError(f"{path}: no documents ({why})")


def _iter_file(
    path: str, json_keys: list[str], skip_bad_records: bool, skipped: SkippedRecords
) -> Iterator[Document]:
    if path.endswith(".jsonl.gz"):
        with gzip.open(path, "rb") as f:
            try:
                yield from _iter_jsonl(f, path, json_keys, skip_bad_records, skipped)
            except (OSError, EOFError) as e:  # corrupt or truncated gzip stream
                raise BadRecordError(f"{path}: unreadable gzip: {e}") from None
    elif path.endswith(".jsonl"):
        with open(path, "rb") as f:
            yield from _iter_jsonl(f, path, json_keys, skip_bad_records, skipped)
    elif path.endswith(".txt"):
        yield _read_txt(path, json_keys)
    elif path.endswith(".parquet"):
        yield from _iter_parquet(path, json_keys, skip_bad_records, skipped)
    else:
        raise BadRecordError(f"{path}: unsupported input type (want .jsonl, .jsonl.gz, .txt or .parquet)")


def _iter_jsonl(
    f: BinaryIO, path: str, json_keys: list[str], skip_bad_records: bool, skipped: SkippedRecords
) -> Iterator[Document]:
    # Binary lines split on b"\n" only, so line numbers match what `sed -n Np` shows.
    for line_no, raw in enumerate(iter(lambda: f.readline(MAX_RECORD_BYTES + 1), b""), start=1):
        if not raw.strip():  # blank lines (e.g. a trailing newline) carry no record
            continue
        try:
            if len(raw) > MAX_RECORD_BYTES:
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):  # the rest of it, unkept
                    pass
                raise BadRecordError(f"{path}:{line_no}: a record of more than {MAX_RECORD_BYTES >> 20} MiB (a "
                                     "broken file, or a corpus on one line?)")
            yield Document(path, line_no, _parse_json_line(raw, path, line_no, json_keys))
        except BadRecordError as e:
            if not skip_bad_records:
                raise
            skipped.add(e)


def _parse_json_line(raw: bytes, path: str, line_no: int, json_keys: list[str]) -> dict[str, str]:
    where = f"{path}:{line_no}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecordError(f"{where}: invalid UTF-8 at byte {e.start} of the line") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecordError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise BadRecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return _select_fields(record, where, json_keys)


def _select_fields(record: dict, where: str, json_keys: list[str]) -> dict[str, str]:
    fields = {}
    for key in json_keys:
        if key not in record:
            raise BadRecordError(f"{where}: missing key {key!r}")
        value = record[key]
        if not isinstance(value, str):
            raise BadRecordError(f"{where}: key {key!r} is {type(value).__name__}, expected a string")
        fields[key] = value
    return fields


def _read_txt(path: str, json_keys: list[str]) -> Document:
    # Megatron convention: a whole .txt file is a single document, so it can fill only one field.
    if len(json_keys) != 1:
        raise BadRecordError(f"{path}: a .txt file is one document with one field; got json keys {json_keys}")
    with open(path, "rb") as f:
        raw = f.read(MAX_RECORD_BYTES + 1)
    if len(raw) > MAX_RECORD_BYTES:
        raise BadRecordError(f"{path}: a .txt file is one document, and this one is more than "
                             f"{MAX_RECORD_BYTES >> 20} MiB: split it, or write it as .jsonl")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = raw.count(b"\n", 0, e.start) + 1
        raise BadRecordError(f"{path}:{line_no}: invalid UTF-8 at byte offset {e.start}") from None
    return Document(path, 1, {json_keys[0]: text})


def _iter_parquet(
    path: str, json_keys: list[str], skip_bad_records: bool, skipped: SkippedRecords
) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadRecordError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    pf = pq.ParquetFile(path)
    missing = [k for k in json_keys if k not in pf.schema_arrow.names]
    if missing:
        raise BadRecordError(f"{path}: missing column(s) {missing}; has {pf.schema_arrow.names}")
    row = 0
    for batch in pf.iter_batches(columns=json_keys, batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            try:
                yield Document(path, row, _select_fields(record, f"{path}:{row}", json_keys))
            except BadRecordError as e:
                if not skip_bad_records:
                    raise
                skipped.add(e)
