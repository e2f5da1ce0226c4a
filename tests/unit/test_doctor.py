"""The doctor's failure path without starting a run: a failed check is named with its log, and the exit code is 1."""

from __future__ import annotations

import json


def test_a_failed_check_is_named_and_the_doctor_exits_1(tmp_path, monkeypatch, capsys):
    """The failure path without starting a run: every training run fails as a broken one would; each check says
    FAIL with the run's log and reason, the others still run, and the exit code is 1."""
    from recipes import doctor

    def broken_run(self, name: str, args: list[str]) -> None:
        raise RuntimeError(f"exit 2; see {self.logs / f'{name}.log'}: config error: model.hidden_size=7 is invalid")

    monkeypatch.setattr(doctor.Runs, "_run", broken_run)
    report = tmp_path / "report.json"
    assert doctor.main(["--workdir", str(tmp_path / "work"), "--json", str(report)]) == 1
    out = capsys.readouterr().out
    status = {c["name"]: (c["status"], c["detail"]) for c in json.loads(report.read_text())["checks"]}
    assert status["train 5 steps"][0] == "FAIL" and "init.log: config error" in status["train 5 steps"][1]
    assert status["megatron-core"][0] == "PASS" and "FAIL  train 5 steps: exit 2; see" in out
    assert f"logs of failed runs: {tmp_path / 'work' / 'logs'}" in out
