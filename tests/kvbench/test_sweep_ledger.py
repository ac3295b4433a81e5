"""The sweep ledger (kvbench/sweep_ledger.py): exit codes of jobs run by other processes."""

from __future__ import annotations

from types import SimpleNamespace

from kvbench import sweep_ledger
from kvbench.runner import finish_sweep


def test_jobs_record_and_the_submitter_collects_in_job_order(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(sweep_ledger.LEDGER_ENV, raising=False)
    assert sweep_ledger.record(0, "niah/x/snapkv/b0.5", 1) is False  # no sweep started: nothing recorded
    cfg = SimpleNamespace(hydra=SimpleNamespace(sweep=SimpleNamespace(dir=str(tmp_path / "sweep"))))
    sweep_ledger.SweepLedger().on_multirun_start(cfg)
    folder = sweep_ledger.os.environ[sweep_ledger.LEDGER_ENV]
    assert folder.startswith(str(tmp_path / "sweep" / ".exit_codes"))
    for num, job, code in [(10, "niah/x/full/b1.0", 0), (2, "niah/x/snapkv/b24", 2), (3, "niah/x/selkv/b0.5", 1)]:
        assert sweep_ledger.record(num, job, code)
    (tmp_path / "sweep" / ".exit_codes").joinpath(folder.rsplit("/", 1)[1], "job99.json").write_text("{not json")
    assert finish_sweep() == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: sweep job niah/x/snapkv/b24 exited 2: configuration error",
        "error: sweep job niah/x/selkv/b0.5 exited 1: some samples failed (stored with their error; rerun to retry them)",
        "sweep: 2 of 3 jobs did not finish cleanly; fix the configuration errors above, then rerun the same command "
        "to retry them (finished jobs are skipped)",
    ]
    assert sweep_ledger.LEDGER_ENV not in sweep_ledger.os.environ and sweep_ledger.collect() == []
