"""data_prep as commands: CLI errors without a traceback, lazy input, interrupted runs leave no dataset, training
on prepared data, and the benchmark."""

import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.corpora import BAD_LINES, code_docs, write_jsonl
from tests.launch import ROOT

with warnings.catch_warnings():  # importing megatron.core warns about missing Apex/TE
    warnings.simplefilter("ignore")

    from data_prep import preprocess as preprocess_mod


def test_cli_bad_record_message_without_traceback(tmp_path):
    # train_tokenizer does not import megatron/torch, so this subprocess stays cheap.
    src = tmp_path / "bad.jsonl"
    src.write_bytes(BAD_LINES["malformed_json"][0])
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep.train_tokenizer", "--input", str(src), "--vocab-size", "300",
         "--model-type", "bpe", "--output-prefix", str(tmp_path / "t")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith(f"error: {src}:2: malformed JSON")
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("t.*"))


def _prepare(sentencepiece_model: Path, texts: list[str], prefix: Path) -> str:
    src = write_jsonl(prefix.with_suffix(".jsonl"), texts)
    return preprocess_mod.preprocess([str(src)], str(prefix), str(sentencepiece_model)).prefixes[0]


def test_preprocess_pulls_input_lazily(sentencepiece_model):
    """Streaming: with an endless input, results arrive while at most max_in_flight batches are read."""
    pulled = []

    def endless():
        for i in itertools.count():
            pulled.append(i)
            yield [{"text": f"def f{i}(x):\n    return x\n"}] * 8

    with multiprocessing.Pool(1, preprocess_mod._init_worker, (str(sentencepiece_model), None, True, False)) as pool:
        results = preprocess_mod._encode_in_order(pool, endless(), max_in_flight=3)
        for k in range(6):
            assert len(next(results)["text"][1]) == 8
            assert len(pulled) == k + 3


def _start_preprocess_and_wait_until_writing(sentencepiece_model: Path, prefix: Path) -> subprocess.Popen:
    """preprocess reading a FIFO that delivers 2,000 documents and then stays open: the run is
    mid-way for as long as the test wants, whatever the machine's speed."""
    fifo = prefix.parent / "input.jsonl"
    os.mkfifo(fifo)
    # Output to a file, not a pipe: reading a pipe to EOF would also wait for any process that
    # inherited it, and this test is about the run's own exit.
    log = open(prefix.parent.parent / f"{prefix.parent.name}.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_prep.preprocess", "--input", str(fifo),
         "--output-prefix", str(prefix), "--tokenizer-model", str(sentencepiece_model), "--append-eod", "--workers", "1"],
        cwd=ROOT, stdout=log, stderr=log, text=True, start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        # A suite started in the background by a non-interactive shell inherits SIGINT ignored,
        # and Python then never raises KeyboardInterrupt: give the run the default, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    proc.log = log
    writer = open(fifo, "w")  # blocks until preprocess opens the FIFO for reading
    writer.writelines(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(2000))
    writer.flush()
    proc.input_writer = writer  # closed by the test after the signal, so the run never sees EOF first
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        tmp = list(prefix.parent.glob(f"{prefix.name}_text_document.bin.tmp-*"))
        if tmp and tmp[0].stat().st_size > 0:  # tokens are being written
            return proc
        assert proc.poll() is None, f"preprocess ended before it could be interrupted:\n{_output(proc)}"
        time.sleep(0.05)
    raise AssertionError("preprocess never started writing")


def _output(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read()


def _close_quietly(writer) -> None:
    try:
        writer.close()
    except BrokenPipeError:  # the reader is gone: nothing left to tell it
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session started for this test: the run and its workers
    except ProcessLookupError:
        pass


def _interrupt(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the run (not its workers), wait for it to end, then close its input."""
    try:
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        _close_quietly(proc.input_writer)


def test_sigkill_midway_leaves_no_dataset_under_the_final_name(sentencepiece_model, tmp_path):
    prefix = tmp_path / "d"
    proc = _start_preprocess_and_wait_until_writing(sentencepiece_model, prefix)
    try:
        _interrupt(proc, signal.SIGKILL)
        assert proc.returncode == -signal.SIGKILL
    finally:
        _kill_group(proc)  # a killed run cannot stop its workers
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != "input.jsonl")
    assert "d_text_document.bin" not in names and "d_text_document.idx" not in names, names
    assert all(".tmp-" in n for n in names), names  # only temp files may remain


def test_sigint_midway_exits_nonzero_and_cleans_up(sentencepiece_model, tmp_path):
    prefix = tmp_path / "d"
    proc = _start_preprocess_and_wait_until_writing(sentencepiece_model, prefix)
    try:
        _interrupt(proc, signal.SIGINT)
        with pytest.raises(ProcessLookupError):  # the run stopped and reaped its workers itself
            os.killpg(proc.pid, 0)
    finally:
        _kill_group(proc)
    output = _output(proc)
    assert proc.returncode == 1 and "interrupted: no output written" in output and "Traceback" not in output, output
    assert [p.name for p in tmp_path.iterdir()] == ["input.jsonl"]


def test_dataset_from_data_prep_trains(sentencepiece_model, tmp_path):
    from tests.launch import SINGLE_PROCESS, SMALL_MODEL, run_pretrain

    prefix = _prepare(sentencepiece_model, code_docs(400), tmp_path / "mine")
    from megatron_ext.metrics.run_logger import read_scalars

    run_pretrain(1, [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=6", f"data.blend=[{prefix}]",
                     f"data.tokenizer_model={sentencepiece_model}", f"logging.tensorboard_dir={tmp_path / 'tb'}"])
    losses = read_scalars(tmp_path / "tb", "train/lm_loss")
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1] - 0.5, losses


def test_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep.benchmark", "--size-mb", "1", "--workers", "1",
         "--vocab-size", "1000", "--out-dir", str(tmp_path / "work"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tok/CPU-s" in proc.stdout and "outputs identical across all sentencepiece runs: yes" in proc.stdout
    assert "of tokenizers' single-thread encode per worker" in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert [(r["impl"], r["workers"]) for r in result["runs"]] == [
        ("tokenizers-1thread", 1), ("megatron-style", 1), ("data_prep", 1), ("data_prep-hf", 1)]
    reference, baseline, ours, hf = result["runs"]
    assert hf["tokens_per_s_per_worker"] > 0 and hf["tokens"] == reference["tokens"] > 0
    assert result["identical_outputs"] and baseline["tokens"] == ours["tokens"] > 0
    assert all(r["main_rss_mb"] > 0 and r["cpu_seconds"] > 0 for r in result["runs"])
    assert not list((tmp_path / "work").glob("out-*"))  # scratch datasets are removed


def test_a_full_disk_is_one_line_exit_6_and_leaves_no_file(sentencepiece_model, tmp_path):
    """The output on a 256 KiB tmpfs (the tests run as root): disk full mid-write. One line, exit 6 (a storage
    error, which the SLURM templates do not requeue), no traceback, and not a byte left behind."""
    full = tmp_path / "small-disk"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        src = write_jsonl(tmp_path / "input.jsonl", [text * 40 for text in code_docs(400)])
        proc = subprocess.run([sys.executable, "-m", "data_prep.preprocess", "--input", str(src), "--output-prefix",
                               str(full / "d"), "--tokenizer-model", str(sentencepiece_model)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 6, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if "storage error" in line]
        assert len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in proc.stderr, \
            proc.stderr[-3000:]
        assert list(full.iterdir()) == []
    finally:
        subprocess.run(["umount", str(full)], capture_output=True)
