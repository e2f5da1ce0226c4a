"""data_prep in this process: tokenizer training, preprocessing to .bin/.idx byte-identical to Megatron-LM, bad
input, readers, inspect and merge."""

import dataclasses
import gzip
import itertools
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data_prep import train_tokenizer as train_mod
from data_prep.records import SkippedRecords, iter_documents
from data_prep.train_tokenizer import chunk_text
from megatron_ext.data.tokenization_record import read_record, record_path, write_record
from megatron_ext.data.tokenizer import SentencePieceTokenizer
from megatron_ext.errors import BadRecordError
from tests.corpora import BAD_LINES, code_docs, write_jsonl
from tests.megatron_reference import write_reference

with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from data_prep import inspect as inspect_mod
    from data_prep import merge as merge_mod
    from data_prep import preprocess as preprocess_mod


def _exit_message(main, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code not in (0, None)
    return str(exc.value.code)


def test_tokenizer_special_ids_and_byte_fallback(sentencepiece_model):
    sp = spm.SentencePieceProcessor(model_file=str(sentencepiece_model))
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    tok = SentencePieceTokenizer(str(sentencepiece_model))
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad) == (300, 1, 2, -1)
    text = "def ünïcode_日本(x):\n\treturn  x  # ✓\n"  # unseen chars, tab, double spaces
    ids = tok.tokenize(text)
    assert tok.bos not in ids and tok.eod not in ids and sp.unk_id() not in ids
    assert any(sp.is_byte(i) for i in ids)
    assert tok.detokenize(ids) == text
    assert tok.tokenize_batch([text, "x"]) == [ids, tok.tokenize("x")]


def test_tokenizer_pickles_by_path(sentencepiece_model):
    import pickle

    tok = pickle.loads(pickle.dumps(SentencePieceTokenizer(str(sentencepiece_model))))
    assert tok.tokenize("def f(x)") == SentencePieceTokenizer(str(sentencepiece_model)).tokenize("def f(x)")
    assert tok.unique_identifiers["tokenizer_path"] == str(sentencepiece_model)


def test_train_tokenizer_is_deterministic(code_corpus, sentencepiece_model, tmp_path):
    # A different output directory too: the path must not leak into the .model bytes.
    train_mod.main(["--input", str(code_corpus), "--vocab-size", "300", "--model-type", "bpe",
                    "--output-prefix", str(tmp_path / "again")])
    assert (tmp_path / "again.model").read_bytes() == sentencepiece_model.read_bytes()
    assert (tmp_path / "again.vocab").read_bytes() == sentencepiece_model.with_suffix(".vocab").read_bytes()
    assert not list(tmp_path.glob("*.tmp-*"))


def test_preprocess_roundtrip_deterministic_and_megatron_identical(sentencepiece_model, tmp_path):
    texts = code_docs(23)
    texts[5] = ""  # empty document: no tokens, no EOD
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        preprocess_mod.main(["--input", str(src), "--output-prefix", str(prefix), "--tokenizer-model",
                             str(sentencepiece_model), "--json-keys", "text", "--append-eod", "--workers", str(workers),
                             "--chunk-docs", "4"])
        outputs[workers] = [Path(f"{prefix}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")]
    assert outputs[1] == outputs[2]

    sp = SentencePieceTokenizer(str(sentencepiece_model))
    write_reference(texts, sp.tokenize, sp.eod, sp.vocab_size, tmp_path / "ref")
    assert outputs[1] == [(tmp_path / f"ref.{ext}").read_bytes() for ext in ("bin", "idx")]

    tok = SentencePieceTokenizer(str(sentencepiece_model))
    ds = IndexedDataset(str(tmp_path / "w1_text_document"))
    assert ds.index.dtype == np.uint16
    assert len(ds.document_indices) == len(texts) + 1
    nonempty = [t for t in texts if t]
    assert len(ds) == len(nonempty)
    for i, text in enumerate(nonempty):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]


def test_gpt_dataset_accepts_tokenizer(sentencepiece_model, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")  # megatron-core >= 0.17 warns when its log line finds no rank
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    src = write_jsonl(tmp_path / "in.jsonl", code_docs(50))
    result = preprocess_mod.preprocess([str(src)], str(tmp_path / "d"), str(sentencepiece_model))
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=16, blend=(result.prefixes, None), split="100,0,0",
        tokenizer=SentencePieceTokenizer(str(sentencepiece_model)), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pad id colliding with eod would warn here
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [8, 0, 0], lambda: True, config).build()
    assert train._pad_token_id == -1
    assert train[0]["tokens"].shape == (16,)


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_input_exits_naming_file_and_line(case, sentencepiece_model, tmp_path):
    content, expected = BAD_LINES[case]
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    out = tmp_path / "out"
    out.mkdir()
    msg = _exit_message(preprocess_mod.main, ["--input", str(src), "--output-prefix", str(out / "d"),
                                              "--tokenizer-model", str(sentencepiece_model), "--append-eod"])
    assert msg.startswith(f"error: {src}") and expected in msg
    assert list(out.iterdir()) == []  # nothing half-written


def test_unmatched_glob_exits(sentencepiece_model, tmp_path):
    pattern = str(tmp_path / "nothing-*.jsonl")
    msg = _exit_message(preprocess_mod.main, ["--input", pattern, "--output-prefix", str(tmp_path / "d"),
                                              "--tokenizer-model", str(sentencepiece_model)])
    assert msg == f"error: {pattern}: no input file matches"
    msg = _exit_message(train_mod.main, ["--input", pattern, "--vocab-size", "300", "--model-type", "bpe",
                                         "--output-prefix", str(tmp_path / "t")])
    assert msg == f"error: {pattern}: no input file matches"


def test_skip_bad_records_counts_and_reports(sentencepiece_model, tmp_path, caplog):
    lines = [json.dumps({"text": t}).encode() for t in code_docs(10)]
    lines[3] = b'{"text": 7}'
    lines[7] = b"{not json"
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level("INFO"):
        preprocess_mod.main(["--input", str(src), "--output-prefix", str(tmp_path / "d"), "--tokenizer-model",
                             str(sentencepiece_model), "--append-eod", "--skip-bad-records"])
    assert f"skipped bad records: 2 (first: {src}:4: key 'text' is int" in caplog.text
    assert f"{src}:8: malformed JSON" in caplog.text
    assert len(IndexedDataset(str(tmp_path / "d_text_document"))) == 8


@pytest.fixture
def fill_disk_on_finalize(monkeypatch):
    """Call it to make the builder write part of the .idx and then fail as a full disk would."""

    def broken_finalize(self, idx_path):
        Path(idx_path).write_bytes(b"partial")
        raise OSError("disk full")

    return lambda: monkeypatch.setattr(IndexedDatasetBuilder, "finalize", broken_finalize)


def test_failure_during_finalize_leaves_no_pair(sentencepiece_model, tmp_path, fill_disk_on_finalize):
    src = write_jsonl(tmp_path / "in.jsonl", code_docs(5))
    out = tmp_path / "out"
    fill_disk_on_finalize()
    with pytest.raises(OSError, match="disk full"):
        preprocess_mod.preprocess([str(src)], str(out / "d"), str(sentencepiece_model), workers=2)
    assert list(out.iterdir()) == []


def test_reader_formats(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "gz doc", "id": 1}\n'))
    (tmp_path / "b.txt").write_text("line one\nline two\n", encoding="utf-8")
    write_jsonl(tmp_path / "c.jsonl", ["c1", "c2"])
    docs = list(iter_documents([str(tmp_path / "*.txt"), str(tmp_path / "*.jsonl*")], ["text"], False))
    assert [(Path(d.path).name, d.line, d.fields["text"]) for d in docs] == [
        ("b.txt", 1, "line one\nline two\n"), ("a.jsonl.gz", 1, "gz doc"),
        ("c.jsonl", 1, "c1"), ("c.jsonl", 2, "c2")]
    (tmp_path / "bad.txt").write_bytes(b"ok\nfine\n\xff\n")
    with pytest.raises(BadRecordError, match=r"bad\.txt:3: invalid UTF-8"):
        list(iter_documents([str(tmp_path / "bad.txt")], ["text"], True))


def test_an_oversized_record_is_refused_without_being_read_whole(tmp_path, monkeypatch):
    """A line (or a gzip stream decompressing into one) past MAX_RECORD_BYTES is a bad record named by file:line;
    skipped, the reader goes on with the next line."""
    from data_prep import records

    monkeypatch.setattr(records, "MAX_RECORD_BYTES", 64)
    long_line = b'{"text": "' + b"x" * 1000 + b'"}\n'
    for name, data in [("big.jsonl", long_line + b'{"text": "next"}\n'),
                       ("big.jsonl.gz", gzip.compress(long_line + b'{"text": "next"}\n'))]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(BadRecordError, match=rf"{name}:1: a record of more than 0 MiB"):
            list(iter_documents([str(tmp_path / name)], ["text"], False))
        skipped = SkippedRecords()
        docs = list(iter_documents([str(tmp_path / name)], ["text"], True, skipped))
        assert [(d.line, d.fields["text"]) for d in docs] == [(2, "next")] and skipped.count == 1
    (tmp_path / "big.txt").write_bytes(b"y" * 1000)
    with pytest.raises(BadRecordError, match=r"big\.txt: a \.txt file is one document, and this one is more than"):
        list(iter_documents([str(tmp_path / "big.txt")], ["text"], False))


def test_reader_all_bad_file_is_an_error_even_when_skipping(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b'{"a": 1}\n')
    skipped = SkippedRecords()
    with pytest.raises(BadRecordError, match="no documents"):
        list(iter_documents([str(tmp_path / "x.jsonl")], ["text"], True, skipped))
    assert skipped.count == 1


def test_chunk_text_respects_byte_limit():
    text = "short line\n" * 50 + "é" * 100 + "\n" + "tail"
    chunks = list(chunk_text(text, max_bytes=64))
    assert "".join(chunks) == text
    assert max(len(c.encode("utf-8")) for c in chunks) <= 64


# ---------------------------------------------------------------------------------------------
# inspect, merge, interrupted runs, memory bounds, training on prepared data, benchmark
# ---------------------------------------------------------------------------------------------


def _prepare(sentencepiece_model: Path, texts: list[str], prefix: Path) -> str:
    src = write_jsonl(prefix.with_suffix(".jsonl"), texts)
    return preprocess_mod.preprocess([str(src)], str(prefix), str(sentencepiece_model)).prefixes[0]


def _documents(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [inspect_mod.document_tokens(ds, d).tolist() for d in range(len(ds.document_indices) - 1)]


def test_inspect_reports_counts_lengths_histogram_and_samples(sentencepiece_model, tmp_path, capsys):
    texts = code_docs(23)
    texts[5] = ""
    prefix = _prepare(sentencepiece_model, texts, tmp_path / "d")
    tok = SentencePieceTokenizer(str(sentencepiece_model))
    lengths = [len(tok.tokenize(t)) + 1 if t else 0 for t in texts]

    stats = inspect_mod.dataset_stats(prefix)
    assert (stats.documents, stats.sequences, stats.tokens, stats.dtype) == (23, 22, sum(lengths), "uint16")
    assert stats.doc_lengths.tolist() == lengths

    inspect_mod.main([f"{prefix}.idx", "--samples", "3", "--tokenizer-model", str(sentencepiece_model)])  # .idx path works
    out = capsys.readouterr().out
    assert "documents 23  (empty: 1)" in out and f"tokens    {sum(lengths):,d}" in out and "uint16" in out
    nonempty = [n for n in lengths if n]
    assert (f"min 0 | mean {np.mean(lengths):,.1f} | median {np.median(lengths):,.0f} | "
            f"max {max(lengths):,d}") in out
    hist = [re.fullmatch(r"\s*(\S+) \| #*\.? *([\d,]+) \(\s*[\d.]+%\)", line) for line in out.splitlines()
            if line.endswith("%)")]
    assert all(hist) and [m[1] for m in hist[:1]] == ["0"] and hist[0][2] == "1"  # the empty document
    assert sum(int(m[2].replace(",", "")) for m in hist) == 23
    assert min(nonempty) >= 16 and "16-31" in out  # buckets are [2^k, 2^(k+1))
    assert f"vs vocabulary 300 of {sentencepiece_model}: ok" in out and "documents ending with EOD (id 2): 100.0%" in out
    assert "--- document 0:" in out and "--- document 11:" in out and "--- document 22:" in out
    assert texts[0] in out and texts[22] in out  # decoded samples


def test_inspect_without_tokenizer_shows_ids(sentencepiece_model, tmp_path, capsys):
    prefix = _prepare(sentencepiece_model, code_docs(4), tmp_path / "d")
    inspect_mod.main([prefix, "--samples", "1"])
    out = capsys.readouterr().out
    first = SentencePieceTokenizer(str(sentencepiece_model)).tokenize(code_docs(4)[0])[:5]
    assert f"ids: {' '.join(map(str, first))}" in out and "pass --tokenizer-model" in out


def test_inspect_names_the_missing_or_truncated_file(sentencepiece_model, tmp_path):
    prefix = _prepare(sentencepiece_model, code_docs(4), tmp_path / "d")
    msg = _exit_message(inspect_mod.main, [str(tmp_path / "d")])
    assert msg.startswith(f"error: {tmp_path / 'd'}.bin: no such file") and f"did you mean {prefix}" in msg
    Path(f"{prefix}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes()[:-2])
    msg = _exit_message(inspect_mod.main, [prefix])
    assert msg.startswith(f"error: {prefix}.bin: ") and "truncated" in msg
    Path(f"{prefix}.idx").unlink()
    assert _exit_message(inspect_mod.main, [prefix]).startswith(f"error: {prefix}.idx: no such file")


def test_merge_equals_concatenation_and_one_pass_preprocess(sentencepiece_model, tmp_path, caplog):
    texts = code_docs(40)
    texts[20] = ""  # an empty document inside a shard survives the merge
    bounds = [(0, 15), (15, 33), (33, 40)]
    shards = [_prepare(sentencepiece_model, texts[a:b], tmp_path / f"s{i}") for i, (a, b) in enumerate(bounds)]
    whole = _prepare(sentencepiece_model, texts, tmp_path / "whole")
    out = tmp_path / "merged" / "m"
    with caplog.at_level("INFO"):
        merge_mod.main(["--input", f"{shards[0]}.idx", shards[1], f"{shards[2]}.bin",
                        "--output-prefix", str(out)])
    assert "merged 3 shards: 40 documents" in caplog.text and f"data path for training: {out}" in caplog.text

    assert _documents(str(out)) == [doc for shard in shards for doc in _documents(shard)]
    # Merging shards gives exactly the bytes of preprocessing their concatenated input in one run.
    for ext in ("bin", "idx"):
        assert Path(f"{out}.{ext}").read_bytes() == Path(f"{whole}.{ext}").read_bytes()
    # the shards' tokenization record (all the same) carries over; nothing else is left beside them
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.bin", "m.idx", "m.tokenization.json"]
    assert read_record(str(out)) == read_record(shards[0]) and read_record(str(out)).convention == "include-special-tokens"


def test_merge_rejects_mixed_dtypes_missing_and_repeated_shards(sentencepiece_model, tmp_path):
    small = _prepare(sentencepiece_model, code_docs(3), tmp_path / "small")
    wide = tmp_path / "wide"  # what a >65,500-token vocabulary writes
    builder = IndexedDatasetBuilder(f"{wide}.bin", dtype=np.int32)
    builder.add_document([70_000, 5, 2], [3])
    builder.finalize(f"{wide}.idx")
    out = tmp_path / "out" / "m"

    msg = _exit_message(merge_mod.main, ["--input", small, str(wide), "--output-prefix", str(out)])
    assert msg.startswith("error: shards disagree on dtype:")
    assert f"{small} (uint16)" in msg and f"{wide} (int32)" in msg
    legacy = tmp_path / "legacy"  # documents that begin with BOS, recorded as such
    shutil.copy(f"{small}.bin", f"{legacy}.bin")
    shutil.copy(f"{small}.idx", f"{legacy}.idx")
    write_record(record_path(str(legacy)), dataclasses.replace(read_record(small), convention="legacy",
                                                                begins_with_bos=True))
    msg = _exit_message(merge_mod.main, ["--input", small, str(legacy), "--output-prefix", str(out)])
    assert msg.startswith(f"error: the shards mix tokenization conventions: documents begin with BOS in {legacy} "
                          f"but not in {small}"), msg
    msg = _exit_message(merge_mod.main, ["--input", small, str(tmp_path / "nope"),
                                         "--output-prefix", str(out)])
    assert msg.startswith(f"error: {tmp_path / 'nope'}.bin: no such file")
    msg = _exit_message(merge_mod.main, ["--input", f"{small}.bin", f"{small}.idx",
                                         "--output-prefix", str(out)])
    assert "given twice" in msg
    msg = _exit_message(merge_mod.main, ["--input", small, "--output-prefix", small])
    assert "both an input and --output-prefix" in msg
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_merge_failure_leaves_no_pair(sentencepiece_model, tmp_path, fill_disk_on_finalize):
    shards = [_prepare(sentencepiece_model, code_docs(3), tmp_path / f"s{i}") for i in range(2)]
    out = tmp_path / "out"
    fill_disk_on_finalize()
    with pytest.raises(OSError, match="disk full"):
        merge_mod.merge(shards, str(out / "m"))
    assert list(out.iterdir()) == []


def test_synthetic_corpus_is_deterministic_and_size_independent():
    from data_prep.benchmark import iter_synthetic_documents

    a = list(itertools.islice(iter_synthetic_documents(3), 20))
    assert a == list(itertools.islice(iter_synthetic_documents(3), 20))
    assert a != list(itertools.islice(iter_synthetic_documents(4), 20))
    assert any("def " in d for d in a) and any(". " in d for d in a)




def test_the_largest_token_id_is_remembered_per_file_and_recomputed_when_the_file_changes(tmp_path, monkeypatch):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_ext.data import checks
    from megatron_ext.data.datasets import max_token_id

    prefix, cache = str(tmp_path / "d_text_document"), str(tmp_path / "index_cache")

    def write(top: int) -> None:
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
        builder.add_document(torch.tensor([1, top, 3]), [3])
        builder.finalize(f"{prefix}.idx")

    passes = []

    def counting_scan(dataset) -> int:
        passes.append(dataset)
        return max_token_id(dataset)

    monkeypatch.setattr(checks, "max_token_id", counting_scan)
    write(700)
    assert checks.cached_max_token_id(prefix, cache) == 700 and len(passes) == 1
    assert checks.cached_max_token_id(prefix, cache) == 700 and len(passes) == 1  # remembered: no pass
    write(900)  # rewritten: same sizes, another modification time
    assert checks.cached_max_token_id(prefix, cache) == 900 and len(passes) == 2
    times = {suffix: Path(f"{prefix}{suffix}").stat().st_mtime_ns for suffix in (".bin", ".idx")}
    write(800)  # rewritten under the same sizes and modification times (cp -p, rsync -t)
    for suffix, mtime in times.items():
        os.utime(f"{prefix}{suffix}", ns=(mtime, mtime))
    assert checks.cached_max_token_id(prefix, cache) == 800 and len(passes) == 3
    write(900)
    assert checks.cached_max_token_id(prefix, None) == 900 and len(passes) == 4  # next to the data by default
    assert (tmp_path / "cache" / "max_token_id" / "d_text_document.json").is_file()
