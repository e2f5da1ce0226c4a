"""Tests for data_prep: tokenizer training, preprocessing to .bin/.idx, and bad-input handling."""

import gzip
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data_prep import train_tokenizer as train_mod
from data_prep.records import BadRecordError, SkippedRecords, iter_documents
from data_prep.train_tokenizer import chunk_text
from megatron_ext.tokenizer import SentencePieceTokenizer

with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
    warnings.simplefilter("ignore")
    from data_prep import preprocess as preprocess_mod
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

REPO = Path(__file__).resolve().parents[1]
WORDS = ["def", "return", "self", "value", "data", "for", "in", "if", "else", "import", "class", "print"]


def _docs(n: int) -> list[str]:
    # Varied but deterministic Python-ish text over a small alphabet, so a ~300 piece vocab fits.
    docs = []
    for i in range(n):
        lines = [f"def f{i}_{j}(x):\n    return {WORDS[(i + j) % len(WORDS)]} + {i * j}\n"
                 for j in range(1 + i % 5)]
        docs.append("".join(lines))
    return docs


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _write_jsonl(tmp_path_factory.mktemp("corpus") / "train.jsonl", _docs(200))


@pytest.fixture(scope="module")
def model(corpus, tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    train_mod.train_tokenizer([str(corpus)], 300, "bpe", str(prefix))
    return Path(f"{prefix}.model")


def _exit_message(main, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code not in (0, None)
    return str(exc.value.code)


def test_tokenizer_special_ids_and_byte_fallback(model):
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    tok = SentencePieceTokenizer(str(model))
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad) == (300, 1, 2, -1)
    text = "def ünïcode_日本(x):\n\treturn  x  # ✓\n"  # unseen chars, tab, double spaces
    ids = tok.tokenize(text)
    assert tok.bos not in ids and tok.eod not in ids and sp.unk_id() not in ids
    assert any(sp.is_byte(i) for i in ids)
    assert tok.detokenize(ids) == text
    assert tok.tokenize_batch([text, "x"]) == [ids, tok.tokenize("x")]


def test_tokenizer_pickles_by_path(model):
    import pickle

    tok = pickle.loads(pickle.dumps(SentencePieceTokenizer(str(model))))
    assert tok.tokenize("def f(x)") == SentencePieceTokenizer(str(model)).tokenize("def f(x)")
    assert tok.unique_identifiers["tokenizer_path"] == str(model)


def test_train_tokenizer_is_deterministic(corpus, model, tmp_path):
    # A different output directory too: the path must not leak into the .model bytes.
    train_mod.main(["--input", str(corpus), "--vocab-size", "300", "--model-type", "bpe",
                    "--output-prefix", str(tmp_path / "again")])
    assert (tmp_path / "again.model").read_bytes() == model.read_bytes()
    assert (tmp_path / "again.vocab").read_bytes() == model.with_suffix(".vocab").read_bytes()
    assert not list(tmp_path.glob("*.tmp-*"))


def _reference_megatron(texts: list[str], tok: SentencePieceTokenizer, prefix: Path) -> None:
    # Megatron-LM tools/preprocess_data.py without sentence splitting, for one json key.
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tok.vocab_size))
    for text in texts:
        doc_ids, sentence_lens = [], []
        sentence_ids = tok.tokenize(text)
        if len(sentence_ids) > 0:
            doc_ids.extend(sentence_ids)
            sentence_lens.append(len(sentence_ids))
        if len(doc_ids) > 0:
            doc_ids.append(tok.eod)
            sentence_lens[-1] += 1
        builder.add_document(doc_ids, sentence_lens)
    builder.finalize(f"{prefix}.idx")


def test_preprocess_roundtrip_deterministic_and_megatron_identical(model, tmp_path):
    texts = _docs(23)
    texts[5] = ""  # empty document: no tokens, no EOD
    src = _write_jsonl(tmp_path / "in.jsonl", texts)
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        preprocess_mod.main(["--input", str(src), "--output-prefix", str(prefix), "--tokenizer-model",
                             str(model), "--json-keys", "text", "--append-eod", "--workers", str(workers),
                             "--chunk-docs", "4"])
        outputs[workers] = [Path(f"{prefix}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")]
    assert outputs[1] == outputs[2]

    _reference_megatron(texts, SentencePieceTokenizer(str(model)), tmp_path / "ref")
    assert outputs[1] == [(tmp_path / f"ref.{ext}").read_bytes() for ext in ("bin", "idx")]

    tok = SentencePieceTokenizer(str(model))
    ds = IndexedDataset(str(tmp_path / "w1_text_document"))
    assert ds.index.dtype == np.uint16
    assert len(ds.document_indices) == len(texts) + 1
    nonempty = [t for t in texts if t]
    assert len(ds) == len(nonempty)
    for i, text in enumerate(nonempty):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]


def test_gpt_dataset_accepts_tokenizer(model, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    src = _write_jsonl(tmp_path / "in.jsonl", _docs(50))
    result = preprocess_mod.preprocess([str(src)], str(tmp_path / "d"), str(model))
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=16, blend=(result.prefixes, None), split="100,0,0",
        tokenizer=SentencePieceTokenizer(str(model)), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pad id colliding with eod would warn here
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [8, 0, 0], lambda: True, config).build()
    assert train._pad_token_id == -1
    assert train[0]["tokens"].shape == (16,)


BAD_LINES = {
    "malformed_json": (b'{"text": "ok"}\n{"text": "oops\n', "2: malformed JSON"),
    "missing_key": (b'{"text": "ok"}\n{"txt": "oops"}\n', "2: missing key 'text'"),
    "non_string": (b'{"text": "ok"}\n\n{"text": ["a", "b"]}\n', "3: key 'text' is list"),
    "invalid_utf8": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "2: invalid UTF-8"),
    "empty_file": (b"", ": no documents (file is empty)"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_input_exits_naming_file_and_line(case, model, tmp_path):
    content, expected = BAD_LINES[case]
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    out = tmp_path / "out"
    out.mkdir()
    msg = _exit_message(preprocess_mod.main, ["--input", str(src), "--output-prefix", str(out / "d"),
                                              "--tokenizer-model", str(model), "--append-eod"])
    assert msg.startswith(f"error: {src}") and expected in msg
    assert list(out.iterdir()) == []  # nothing half-written


def test_unmatched_glob_exits(model, tmp_path):
    pattern = str(tmp_path / "nothing-*.jsonl")
    msg = _exit_message(preprocess_mod.main, ["--input", pattern, "--output-prefix", str(tmp_path / "d"),
                                              "--tokenizer-model", str(model)])
    assert msg == f"error: {pattern}: no input file matches"
    msg = _exit_message(train_mod.main, ["--input", pattern, "--vocab-size", "300", "--model-type", "bpe",
                                         "--output-prefix", str(tmp_path / "t")])
    assert msg == f"error: {pattern}: no input file matches"


def test_cli_bad_record_message_without_traceback(tmp_path):
    # train_tokenizer does not import megatron/torch, so this subprocess stays cheap.
    src = tmp_path / "bad.jsonl"
    src.write_bytes(BAD_LINES["malformed_json"][0])
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep.train_tokenizer", "--input", str(src), "--vocab-size", "300",
         "--model-type", "bpe", "--output-prefix", str(tmp_path / "t")],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith(f"error: {src}:2: malformed JSON")
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("t.*"))


def test_skip_bad_records_counts_and_reports(model, tmp_path, caplog):
    lines = [json.dumps({"text": t}).encode() for t in _docs(10)]
    lines[3] = b'{"text": 7}'
    lines[7] = b"{not json"
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level("INFO"):
        preprocess_mod.main(["--input", str(src), "--output-prefix", str(tmp_path / "d"), "--tokenizer-model",
                             str(model), "--append-eod", "--skip-bad-records"])
    assert f"skipped bad records: 2 (first: {src}:4: key 'text' is int" in caplog.text
    assert f"{src}:8: malformed JSON" in caplog.text
    assert len(IndexedDataset(str(tmp_path / "d_text_document"))) == 8


def test_failure_during_finalize_leaves_no_pair(model, tmp_path, monkeypatch):
    src = _write_jsonl(tmp_path / "in.jsonl", _docs(5))
    out = tmp_path / "out"

    def broken_finalize(self, idx_path):
        Path(idx_path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", broken_finalize)
    with pytest.raises(OSError, match="disk full"):
        preprocess_mod.preprocess([str(src)], str(out / "d"), str(model), workers=2)
    assert list(out.iterdir()) == []


def test_reader_formats(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "gz doc", "id": 1}\n'))
    (tmp_path / "b.txt").write_text("line one\nline two\n", encoding="utf-8")
    _write_jsonl(tmp_path / "c.jsonl", ["c1", "c2"])
    docs = list(iter_documents([str(tmp_path / "*.txt"), str(tmp_path / "*.jsonl*")], ["text"], False))
    assert [(Path(d.path).name, d.line, d.fields["text"]) for d in docs] == [
        ("b.txt", 1, "line one\nline two\n"), ("a.jsonl.gz", 1, "gz doc"),
        ("c.jsonl", 1, "c1"), ("c.jsonl", 2, "c2")]
    (tmp_path / "bad.txt").write_bytes(b"ok\nfine\n\xff\n")
    with pytest.raises(BadRecordError, match=r"bad\.txt:3: invalid UTF-8"):
        list(iter_documents([str(tmp_path / "bad.txt")], ["text"], True))


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
