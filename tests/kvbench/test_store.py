"""The results store: flushed JSON lines, repair of a truncated last line, the shard lock, atomic writes."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

import kvbench.job.store
from kvbench.job.store import JobLockedError, JobStore, atomic_write
from tests.kvbench.cli_util import ROOT, cli_env, job_dir, run_cli, tiny_model_args


def rec(i: int, error: dict | None = None) -> dict:
    return {"id": f"s{i}", "dataset": "d", "prediction": f"answer {i}", "score": 0.5, "error": error}


def test_append_records_latest_and_done_ids(tmp_path):
    store = JobStore(tmp_path / "job")
    assert store.records() == [] and store.done_ids() == set()
    boom = {"type": "RuntimeError", "message": "boom"}
    store.append(rec(0, error=boom))
    store.append(rec(1, error=boom))
    store.append(rec(2))
    assert store.done_ids() == {"s2"}  # failed samples are retried by the next run
    store.append(rec(0))  # the retry succeeded
    assert [r["id"] for r in store.records()] == ["s0", "s1", "s2", "s0"]
    latest = store.latest()
    assert latest["s0"]["error"] is None and latest["s1"]["error"]["type"] == "RuntimeError"
    assert store.done_ids() == {"s0", "s2"}
    assert all(line.endswith("\n") for line in store.predictions.read_text().splitlines(keepends=True))


def test_append_refuses_nan_and_writes_nothing(tmp_path):
    store = JobStore(tmp_path)
    store.append(rec(0))
    before = store.predictions.read_bytes()
    with pytest.raises(ValueError):
        store.append({**rec(1), "score": math.nan})
    assert store.predictions.read_bytes() == before


def test_repair_moves_a_truncated_last_line_aside(tmp_path, caplog):
    store = JobStore(tmp_path)
    store.append(rec(0))
    store.append(rec(1))
    tail = b'{"id": "s2", "dataset": "d", "predic'
    with open(store.predictions, "ab") as f:
        f.write(tail)
    assert [r["id"] for r in store.records()] == ["s0", "s1"]  # the tail is not a record
    assert store.repair() == len(tail)
    assert store.predictions.read_bytes().count(b"\n") == 2 and store.predictions.read_bytes().endswith(b"\n")
    (partial,) = tmp_path.glob("predictions.jsonl.partial-*")
    assert partial.read_bytes() == tail
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]  # the move is said, naming both files
    assert str(store.predictions) in warning.getMessage() and partial.name in warning.getMessage()
    assert store.repair() == 0  # idempotent
    assert store.done_ids() == {"s0", "s1"}


def test_lock_refuses_a_second_holder_of_the_same_shard_only(tmp_path):
    store = JobStore(tmp_path)
    with store.locked():
        with pytest.raises(JobLockedError, match="lock_wait_s"), JobStore(tmp_path).locked(wait_s=0.3):
            pass
        with JobStore(tmp_path, (1, 2)).locked():  # another shard of the same job is not blocked
            pass
    with JobStore(tmp_path).locked():  # released at the end of the block
        pass


def test_lock_files_are_removed_when_released(tmp_path):
    store = JobStore(tmp_path)
    with store.locked():
        store.append(rec(0))
        assert {p.name for p in tmp_path.glob(".*lock*")} == {".lock.shard0-of-1"}
    assert not list(tmp_path.glob(".*lock*"))


def test_a_waiter_on_a_removed_lock_file_locks_the_new_one(tmp_path, monkeypatch):
    """B opened the lock file while A held it; A releases (removes the file, then unlocks); B's lock of the removed
    file is refused (its inode is no longer at the path) and B locks the path's new file, which C holds by then:
    B enters only after C. A lock that ignored the removal would let B and C in together."""
    import fcntl
    import threading

    path, flocks, inside = tmp_path / ".append.lock", [], []
    b_blocked, b_retries, c_done = threading.Event(), threading.Event(), threading.Event()

    def flock(fd, op):
        if threading.current_thread().name == "B":
            flocks.append(os.fstat(fd).st_ino)
            (b_blocked if len(flocks) == 1 else b_retries).set()
            if len(flocks) == 2:
                assert c_done.wait(30)
        return fcntl.flock(fd, op)

    monkeypatch.setattr(kvbench.job.store, "fcntl", type("F", (), {"flock": staticmethod(flock), "LOCK_EX": fcntl.LOCK_EX,
                                                               "LOCK_NB": fcntl.LOCK_NB}))

    def b():
        with kvbench.job.store.file_lock(path):
            inside.append("B")

    with kvbench.job.store.file_lock(path):  # A
        thread = threading.Thread(target=b, name="B")
        thread.start()
        assert b_blocked.wait(30)  # B has the old file open and is about to wait for it
    assert b_retries.wait(30) and not inside  # B locked the removed file, let it go and tries the new one
    with kvbench.job.store.file_lock(path, 0, lambda: AssertionError("C must get the lock: B does not hold it")):  # C
        assert not inside
        c_done.set()
    thread.join(30)
    assert inside == ["B"] and not path.exists()  # (B retried once more: C removed the file it waited on)


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    code = f"""
        import sys
        from kvbench.job.store import JobStore
        with JobStore({str(tmp_path)!r}).locked():
            print("locked", flush=True)
            sys.stdin.readline()
        """
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=cli_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(JobLockedError), JobStore(tmp_path).locked():
            pass
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs
        holder.wait()
    with JobStore(tmp_path).locked():
        pass


def test_two_shards_appending_concurrently_write_whole_lines(tmp_path):
    code = """
        import sys
        from kvbench.job.store import JobStore
        k = int(sys.argv[1])
        s = JobStore({path!r}, (k, 2))
        for i in range(100):
            s.append({{"id": f"{{k}}/{{i}}", "prediction": "y" * (i * 37 % 5000), "error": None}})
        """.format(path=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(k)], cwd=ROOT, env=cli_env())
             for k in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ids = [json.loads(line)["id"] for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 200


def test_atomic_write_replaces_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write(target, '{"old": true}\n')
    atomic_write(target, '{"new": true}\n')
    assert target.read_text() == '{"new": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_atomic_write_keeps_the_old_file_when_the_rename_fails(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text('{"old": true}\n')

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError) as err:
        atomic_write(target, '{"new": true}\n')
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(target))  # the one line names the file
    assert target.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_write_json_keeps_the_old_file_when_serialising_fails(tmp_path):
    store = JobStore(tmp_path)
    store.write_json("summary.json", {"n": 1})

    class Unprintable:
        def __str__(self):
            raise RuntimeError("cannot format")

    with pytest.raises(RuntimeError):
        store.write_json("summary.json", {"n": Unprintable()})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_cli_exits_3_when_the_job_shard_is_locked(tmp_path, tiny_model_dir):
    """Through run.py: the lock is taken before the model loads; the second command exits 3."""
    args = [*tiny_model_args(tiny_model_dir), f"output_root={tmp_path}", "quiet=true"]
    folder = job_dir(args)
    with JobStore(folder).locked():
        out = run_cli(args)
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stderr.splitlines()[-1].startswith("error: ") and str(folder) in out.stderr
    assert not (folder / "predictions.jsonl").exists()


def test_a_corrupt_record_in_the_middle_is_one_oserror_naming_the_line(tmp_path):
    store = JobStore(tmp_path / "job")
    store.append({"id": "a", "error": None})
    with open(store.predictions, "a") as f:
        f.write('{"id": "\x01"}\n')
    store.append({"id": "b", "error": None})
    with pytest.raises(OSError, match=r"predictions\.jsonl: line 2 is not a JSON record \(Invalid control character "
                                      r"at: line 1 column 9 \(char 8\);"):  # the whole reason
        store.records()


class FullDisk(io.FileIO):
    """A file on a full disk: ``write`` stores what fits (5 bytes) and says so, as write(2) does."""

    def write(self, data):
        return super().write(bytes(data)[:5])


def full_disk_appends(monkeypatch):
    """Appends to ``predictions.jsonl`` (the store's only ``ab`` open) go to a full disk."""
    real = open
    monkeypatch.setattr(kvbench.job.store, "open", lambda path, mode="r", *a, **k: FullDisk(path, mode) if mode == "ab"
                        else real(path, mode, *a, **k), raising=False)


def fsync_fails(monkeypatch):
    def fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("fault, code", [(full_disk_appends, errno.ENOSPC), (fsync_fails, errno.EIO)])
def test_an_append_that_fails_names_the_file_and_leaves_no_half_line(tmp_path, monkeypatch, fault, code):
    store = JobStore(tmp_path)
    store.append(rec(0))
    before = store.predictions.read_bytes()
    with monkeypatch.context() as mp:
        fault(mp)
        with pytest.raises(OSError) as err:
            store.append(rec(1))
    assert (err.value.errno, err.value.filename) == (code, str(store.predictions))
    assert store.predictions.read_bytes() == before  # another shard's next line starts on a line of its own
    store.append(rec(2))
    assert [r["id"] for r in store.records()] == ["s0", "s2"]


def test_a_full_disk_while_a_job_stores_is_one_line_naming_the_file_and_exit_1(
        tmp_path, tiny_model_dir, haystack_dir, monkeypatch, capsys):
    """Issue #37.5: the job stops with exit 1 and one line naming predictions.jsonl; what the first
    run stored (records, config.yaml) is kept, and the rerun resumes."""
    import run

    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[256]", "task.depth_percents=[20,80]",
            "task.max_new_tokens=2", f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path}", "quiet=true",
            "threads=1"]
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")

    def run_job(*extra):
        monkeypatch.setattr(sys, "argv", ["run.py", *args, *extra])
        with pytest.raises(SystemExit) as done:
            run.main()
        return done.value.code

    assert run_job("max_samples=1") == 0
    (predictions,) = tmp_path.rglob("predictions.jsonl")
    stored, _ = predictions.read_bytes(), capsys.readouterr()
    with monkeypatch.context() as mp:
        full_disk_appends(mp)
        assert run_job() == 1
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [err.splitlines()[-1]]
    assert str(predictions) in err and "Traceback" not in err
    assert predictions.read_bytes() == stored and (predictions.parent / "config.yaml").is_file()
    assert run_job() == 0 and len(predictions.read_text().splitlines()) == 2


def test_a_full_disk_while_writing_config_yaml_leaves_no_job_folder(tmp_path, tiny_model_dir, haystack_dir, monkeypatch,
                                                                    capsys):
    """Issue #37.5: a job that fails before its first sample leaves nothing but its error line (exit 1, the path
    named); what was in output_root before stays."""
    import run

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept.txt").write_text("stored earlier")
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith("config.yaml"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["run.py", *tiny_model_args(tiny_model_dir), "task.context_lengths=[256]",
                                      f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path / 'out'}", "quiet=true"])
    with pytest.raises(SystemExit) as done:
        run.main()
    err = capsys.readouterr().err.splitlines()
    assert done.value.code == 1 and len(err) == 1 and err[0].startswith("error: ") and "config.yaml" in err[0], err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["kept.txt"]


def test_a_job_that_stored_nothing_removes_its_folder_unless_another_shard_runs(tmp_path):
    kept = JobStore(tmp_path / "a" / "job", (0, 2))
    with JobStore(kept.path, (1, 2)).locked():  # shard 1 runs
        with kept.locked():
            pass
        kept.discard_if_empty()  # after its own lock is released (and removed), as run_jobs' ExitStack does
    assert kept.path.is_dir()
    gone = JobStore(tmp_path / "b" / "job", (0, 2))
    with gone.locked():
        pass
    gone.discard_if_empty()
    assert not (tmp_path / "b").exists()
