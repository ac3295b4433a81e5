"""The results store: truncated lines repaired, appends never glued, atomic writes, the run lock."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from kvbench.store import JobLockedError, JobStore, atomic_write, folder_method_overrides, job_relpath
from tests.kvbench.cli_util import ROOT, cli_env


def rec(i: int, error: dict | None = None) -> dict:
    return {"id": f"s{i}", "dataset": "d", "prediction": f"answer {i}", "score": 0.5, "error": error}


def test_repair_moves_a_truncated_last_line_aside(tmp_path):
    store = JobStore(tmp_path)
    store.append(rec(0))
    store.append(rec(1))
    tail = b'{"id": "s2", "dataset": "d", "predic'
    with open(store.predictions, "ab") as f:
        f.write(tail)
    assert [r["id"] for r in store.records()] == ["s0", "s1"]  # the tail is not a record
    assert store.repair() == len(tail)
    lines = store.predictions.read_bytes().splitlines(keepends=True)
    assert [json.loads(x)["id"] for x in lines] == ["s0", "s1"] and all(x.endswith(b"\n") for x in lines)
    (partial,) = tmp_path.glob("predictions.jsonl.partial-*")
    assert partial.read_bytes() == tail
    assert store.repair() == 0  # idempotent
    assert store.done_ids() == {"s0", "s1"}  # s2 has no record: a resumed run redoes it


def test_append_after_a_crash_never_glues_onto_the_truncated_line(tmp_path):
    store = JobStore(tmp_path, (1, 2))
    store.append(rec(0))
    with open(store.predictions, "ab") as f:  # another shard killed mid-write
        f.write(b'{"id": "s9", "dat')
    store.append(rec(1))  # this shard goes on without calling repair()
    assert [r["id"] for r in store.records()] == ["s0", "s1"]
    assert len(list(tmp_path.glob("predictions.jsonl.partial-*"))) == 1
    assert all(json.loads(line) for line in store.predictions.read_text().splitlines())


def test_records_keep_the_last_record_per_id_and_done_ids_skip_failures(tmp_path):
    store = JobStore(tmp_path)
    store.append(rec(0, error={"type": "RuntimeError", "message": "boom"}))
    store.append(rec(1, error={"type": "RuntimeError", "message": "boom"}))
    assert store.done_ids() == set()
    store.append(rec(0))  # the retry succeeded
    by_id = {r["id"]: r for r in store.records()}
    assert by_id["s0"]["error"] is None and by_id["s1"]["error"]["type"] == "RuntimeError"
    assert store.done_ids() == {"s0"}


def test_append_refuses_nan_and_writes_nothing(tmp_path):
    store = JobStore(tmp_path)
    store.append(rec(0))
    before = store.predictions.read_bytes()
    with pytest.raises(ValueError):
        store.append({**rec(1), "score": math.nan})
    assert store.predictions.read_bytes() == before


def test_atomic_write_keeps_the_old_file_when_the_rename_fails(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text('{"old": true}\n')

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        atomic_write(target, '{"new": true}\n')
    assert target.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temp file left behind


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    store = JobStore(tmp_path)
    store.write_json("summary.json", {"n": 1})

    class Unserialisable:
        def __str__(self):
            raise RuntimeError("cannot format")

    with pytest.raises(RuntimeError):
        store.write_json("summary.json", {"n": Unserialisable()})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"n": 1}


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=cli_env(**env),
                          capture_output=True, text=True, timeout=120)


def test_kill_9_between_temp_write_and_rename_leaves_the_old_file(tmp_path):
    (tmp_path / "summary.json").write_text('{"n": 1}\n')
    out = _python(
        f"""
        from kvbench.store import JobStore
        JobStore({str(tmp_path)!r}).write_json("summary.json", {{"n": 2, "pad": "x" * 100000}})
        """,
        KVBENCH_CRASH_AT="atomic_write:1",
    )
    assert out.returncode == -9
    assert json.loads((tmp_path / "summary.json").read_text()) == {"n": 1}
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "summary.json"]
    assert all(name.startswith(".summary.json.tmp-") for name in leftovers)


def test_kill_9_mid_append_leaves_a_truncated_line_that_repair_removes(tmp_path):
    out = _python(
        f"""
        from kvbench.store import JobStore
        s = JobStore({str(tmp_path)!r})
        for i in range(5):
            s.append({{"id": f"s{{i}}", "prediction": "x" * 50, "error": None}})
        """,
        KVBENCH_CRASH_AT="append:3",
    )
    assert out.returncode == -9
    data = (tmp_path / "predictions.jsonl").read_bytes()
    assert data.count(b"\n") == 2 and not data.endswith(b"\n")
    store = JobStore(tmp_path)
    assert store.repair() > 0
    assert [r["id"] for r in store.records()] == ["s0", "s1"]


def test_concurrent_appends_from_two_processes_are_all_whole_lines(tmp_path):
    code = """
        import sys
        from kvbench.store import JobStore
        k = int(sys.argv[1])
        s = JobStore({path!r}, (k, 2))
        for i in range(150):
            s.append({{"id": f"{{k}}/{{i}}", "prediction": "y" * (i * 37 % 5000), "error": None}})
        """.format(path=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(k)], cwd=ROOT, env=cli_env())
             for k in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == 300 and len(set(ids)) == 300


HOLD = """
    import sys, time
    from kvbench.store import JobStore
    s = JobStore({path!r})
    s.acquire()
    print("locked", flush=True)
    sys.stdin.readline()  # hold the lock until the test says so
    s.release()
"""


def test_second_process_on_the_same_shard_waits_or_gets_a_clear_error(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD.format(path=str(tmp_path)))], cwd=ROOT,
                              env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(JobLockedError) as err:
            JobStore(tmp_path).acquire(wait_s=0)
        msg = str(err.value)
        assert f"is in use by process {holder.pid};" in msg and "lock_wait_s" in msg and "\n" not in msg
        with pytest.raises(JobLockedError, match=r"after waiting 0.2 s; wait for it to finish or set a longer lock_wait_s \(now 0.2\)$"):
            JobStore(tmp_path).acquire(wait_s=0.2)
        other_shard = JobStore(tmp_path, (1, 2))
        other_shard.acquire(wait_s=0)  # another shard of the same job is not blocked
        other_shard.release()
        holder.stdin.write("go\n")
        holder.stdin.flush()
        waiter = JobStore(tmp_path)
        waiter.acquire(wait_s=60)  # returns once the holder has released the lock
        waiter.release()
    finally:
        holder.kill()
        holder.wait()


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD.format(path=str(tmp_path)))], cwd=ROOT,
                              env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()  # SIGKILL: no cleanup code runs
    holder.wait()
    s = JobStore(tmp_path)
    s.acquire(wait_s=0)
    s.release()


def test_write_config_keeps_a_different_stored_config(tmp_path):
    store = JobStore(tmp_path)
    store.write_config("budget: 0.25\n")
    store.write_config("budget: 0.25\n")
    assert [p.name for p in tmp_path.glob("config*.yaml")] == ["config.yaml"]
    store.write_config("budget: 0.5\n")
    assert (tmp_path / "config.yaml").read_text() == "budget: 0.25\n"
    others = [p for p in tmp_path.glob("config.*.yaml")]
    assert len(others) == 1 and others[0].read_text() == "budget: 0.5\n"
    # two grids in turn (within one second here): one snapshot each, none overwritten
    for text in ("budget: 0.75\n", "budget: 0.5\n", "budget: 0.75\n", "budget: 0.25\n"):
        store.write_config(text)
    texts = sorted(p.read_text() for p in tmp_path.glob("config*.yaml"))
    assert texts == ["budget: 0.25\n", "budget: 0.5\n", "budget: 0.75\n"]


def test_cli_exits_3_when_the_job_is_locked(tmp_path, tiny_model_dir):
    """Through run.py: the lock is taken before the model loads; the second command exits 3."""
    from tests.kvbench.cli_util import run_cli, tiny_model_args

    job = tmp_path / "locked_job"
    job.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD.format(path=str(job)))], cwd=ROOT,
                              env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        out = run_cli([*tiny_model_args(tiny_model_dir), f"output_root={tmp_path}", "run_name=locked_job", "quiet=true"])
        assert out.returncode == 3
        assert out.stderr.strip().splitlines()[-1] == (
            f"error: job folder {job} (shard 0 of 1) is in use by process {holder.pid}; "
            "wait for it to finish or set lock_wait_s=SECONDS to wait"
        )
        assert not (job / "predictions.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def test_stale_temp_files_of_killed_atomic_writes_are_cleaned(tmp_path):
    store = JobStore(tmp_path)
    old = tmp_path / ".summary.json.tmp-4242"
    fresh = tmp_path / ".env.json.tmp-4343"
    old.write_text("{")
    fresh.write_text("{")
    os.utime(old, (old.stat().st_atime - 3600, old.stat().st_mtime - 3600))
    assert store.clean_stale_temp() == [old.name]
    assert not old.exists() and fresh.exists()  # a recent one may belong to a live shard elsewhere


def test_a_token_budget_names_one_folder_however_it_is_written():
    from kvbench.store import job_relpath

    def rel(budget):
        return job_relpath({"budget": budget, "task": {"name": "niah"}, "model": {"name": "m"}, "method": {"name": "snapkv"}})

    assert rel(32) == rel(32.0) == "niah/m/snapkv/b32"
    assert rel(0.25) == "niah/m/snapkv/b0.25"
    assert rel(1.0) == "niah/m/snapkv/b1.0"  # the ratio 1.0 (everything) is not the 1-token budget
    assert rel(1) == "niah/m/snapkv/b1"


def test_discard_if_empty_removes_only_a_folder_holding_nothing_but_its_locks(tmp_path):
    created = tmp_path / "niah"
    job = JobStore(created / "m" / "b0.5", shard=(0, 2))
    with job.locked():
        (job.path / ".lock.shard1-of-2").write_text("")  # another shard runs here: kept
        assert job.discard_if_empty(created) is False
        assert job.path.is_dir()
        (job.path / ".lock.shard1-of-2").unlink()
        assert job.discard_if_empty(created) is True
    assert not created.exists() and tmp_path.is_dir()
    kept = JobStore(tmp_path / "a" / "b")
    (tmp_path / "a" / "other").mkdir()  # a sibling made by another job: the parent stays
    with kept.locked():
        assert kept.discard_if_empty(tmp_path / "a") is True
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["other"]
    held = JobStore(tmp_path / "c")
    with held.locked():
        (held.path / "config.yaml").write_text("x: 1\n")
        assert held.discard_if_empty(held.path) is False
        assert (held.path / "config.yaml").exists()


def test_folder_hash_counts_only_overrides_that_change_the_method():
    """``method.window_size=32`` on a preset with 32 is the preset's job (its folder, no hash);
    changed values, deletions and new keys name a hashed folder; no baseline: every override."""
    from omegaconf import OmegaConf

    preset = {"name": "snapkv", "window_size": 32, "kernel_size": 5, "flag": True, "sub": {"a": 1}}
    calls = []

    def compose(overrides):
        calls.append(overrides)
        return OmegaConf.create({"method": preset, "budget": 0.5})

    job = {**preset, "window_size": 32.0, "kernel_size": 7, "flag": 1, "sub": {"a": 1}, "new": 3}
    ovr = ["budget=0.5", "method.window_size=32.0", "method.kernel_size=7", "method.flag=1", "method.sub.a=1",
           "+method.new=3", "~method.gone"]
    assert folder_method_overrides(ovr, job, compose) == [
        "method.kernel_size=7", "method.flag=1", "method.new=3", "~method.gone"]
    assert calls == [["budget=0.5"]]  # the baseline: the same job without its method.* overrides
    assert folder_method_overrides(["budget=0.5"], job, compose) == []
    # run-control fields (how the arithmetic runs, not what it computes) never name a folder
    assert folder_method_overrides(["method.kernel=torch", "+method.kernel=c", "method.kernel_size=7"],
                                   {**job, "kernel": "torch"}, compose) == ["method.kernel_size=7"]

    def broken(overrides):
        raise RuntimeError("no config")

    assert folder_method_overrides(ovr[:2], job, broken) == ["method.window_size=32.0"]
    # one spelling per value: 2, 2.0 and 2e0 on a float field are one folder; lists as compact JSON
    preset["alpha"] = 0.5
    for typed, value in (("2", 2), ("2.0", 2.0), ("2e0", 2.0)):
        assert folder_method_overrides([f"method.alpha={typed}"], {**preset, "alpha": value}, compose) == [
            "method.alpha=2.0"]
    assert folder_method_overrides(["method.sub=[1, 2]"], {**preset, "sub": [1, 2]}, compose) == ["method.sub=[1,2]"]
    assert job_relpath({"task": {"name": "niah"}, "model": {"name": "smollm2"}, "method": preset,
                        "budget": 0.30000000000000004}) == "niah/smollm2/snapkv/b0.3"
    cfg = {"task": {"name": "niah"}, "model": {"name": "smollm2"}, "method": job, "budget": 0.5}
    same = folder_method_overrides(["method.window_size=32"], job, compose)
    assert job_relpath(cfg, "snapkv", same) == "niah/smollm2/snapkv/b0.5"


def test_an_earlier_runs_env_file_is_kept_when_a_rerun_stores_samples(tmp_path):
    """env.json describes the latest run that stored samples; the earlier one's is kept as
    env.<time>.json (its write time), never overwritten, and not copied twice."""
    store = JobStore(tmp_path / "job")
    store.write_json_with_first_record("env.json", {"run": 1})
    store.append({"id": "a", "score": 1.0})
    os.utime(store.path / "env.json", (1_700_000_000, 1_700_000_000))
    store.write_json_with_first_record("env.json", {"run": 2})
    store.append({"id": "b", "score": 1.0})
    kept = sorted(p.name for p in store.path.glob("env.*.json"))
    assert len(kept) == 1 and kept[0].startswith("env.2023")
    first = kept[0]
    assert json.loads((store.path / kept[0]).read_text()) == {"run": 1}
    assert json.loads((store.path / "env.json").read_text()) == {"run": 2}
    os.utime(store.path / "env.json", (1_700_000_000, 1_700_000_000))  # same second as the kept one
    store.write_json_with_first_record("env.json", {"run": 3})
    store.append({"id": "c", "score": 1.0})
    kept = sorted(p.name for p in store.path.glob("env.*.json"))
    assert {k: json.loads((store.path / k).read_text()) for k in kept} == {
        first: {"run": 1}, first.replace(".json", "-2.json"): {"run": 2}}


def test_a_summary_of_another_selection_is_kept_before_it_is_replaced(tmp_path):
    import json as _json

    from kvbench.job import keep_other_selection_summary

    path = tmp_path / "summary.json"
    assert keep_other_selection_summary(path, {"selection": {}, "n_expected": 9}) is None  # nothing there yet
    whole = {"selection": {"max_samples": None}, "n_expected": 9, "n_samples": 9, "score": 54.63}
    path.write_text(_json.dumps(whole))
    assert keep_other_selection_summary(path, dict(whole, n_samples=8)) is None  # same selection: updated in place
    assert list(tmp_path.iterdir()) == [path]
    kept = keep_other_selection_summary(path, {"selection": {"max_samples": 1}, "n_expected": 1})
    assert kept is not None and kept.name.startswith("summary.") and kept.suffix == ".json"
    assert _json.loads(kept.read_text()) == whole  # the 9-sample scores stay readable
    path.write_text("{broken")
    assert keep_other_selection_summary(path, {"selection": {}, "n_expected": 1}) is None  # unreadable: nothing to keep
