"""The results store: one folder per job, one flushed JSON line per sample, resumable (docs/RESULTS.md)."""

import errno
import fcntl
import json
import logging
import os
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Iterator

PREDICTIONS = "predictions.jsonl"
log = logging.getLogger("kvbench")


class JobLockedError(RuntimeError):
    """Another process is running the same job shard."""


@contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """Re-raise an OS error of the block naming ``path`` (a full disk's ENOSPC names no file)."""
    try:
        yield
    except OSError as e:
        if e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror, str(path)) from e


def atomic_write(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file, fsync and rename (OSError: the old file is left)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with naming(path), open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def file_lock(path: Path, wait_s: float | None = None, busy: Callable[[], Exception] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the block, then remove it; it counts only while ``path`` names the
    locked inode. ``wait_s``: seconds to wait, then ``busy()`` is raised (None: no limit)."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise busy() from None
            time.sleep(0.2)
        except FileNotFoundError:  # removed by the holder it waited for
            pass
        os.close(fd)
    try:
        yield
    finally:
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when it is missing, unreadable or not an object (a summary not yet written)."""
    try:
        return data if isinstance(data := json.loads(path.read_text()), dict) else {}
    except (OSError, ValueError):
        return {}


def is_job_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a job: ``config.yaml`` beside ``identity.json``, ``predictions.jsonl`` or ``summary.json``."""
    return (folder / "config.yaml").is_file() and any((folder / n).exists()
                                                      for n in (PREDICTIONS, "summary.json", "identity.json"))


class JobStore:
    """One job folder, opened by shard ``(index, count)`` of the job (created if absent)."""

    def __init__(self, path: Path | str, shard: tuple[int, int] = (0, 1)):
        self.path, self.shard = Path(path), shard
        self.made = [p for p in (self.path, *self.path.parents) if not p.exists()]  # innermost first
        self.path.mkdir(parents=True, exist_ok=True)
        self.predictions = self.path / PREDICTIONS

    def locked(self, wait_s: float = 0.0):
        """Hold this shard's run lock for the block (:func:`file_lock`); JobLockedError: still held after ``wait_s`` s."""
        return file_lock(self.path / f".lock.shard{self.shard[0]}-of-{self.shard[1]}", wait_s, lambda: JobLockedError(
            f"job folder {self.path} (shard {self.shard[0]} of {self.shard[1]}) is in use by another process; wait for "
            "it, or set lock_wait_s=SECONDS"))

    def append_lock(self):
        """Exclusive lock shared by all shards for each append and for the summary (:func:`file_lock`)."""
        return file_lock(self.path / ".append.lock")

    def repair(self) -> int:
        """Move a truncated last line aside to ``predictions.jsonl.partial-<ms>`` (logged); returns the bytes moved."""
        with self.append_lock():
            data = self.predictions.read_bytes() if self.predictions.exists() else b""
            if not data or data.endswith(b"\n"):
                return 0
            cut = data.rfind(b"\n") + 1
            aside = self.path / f"{PREDICTIONS}.partial-{int(time.time() * 1000)}"
            aside.write_bytes(data[cut:])  # kept as written
            with naming(self.predictions), open(self.predictions, "r+b") as f:
                f.truncate(cut)
                os.fsync(f.fileno())
            log.warning("%s: its last line was cut short (%d bytes, a process killed while writing); moved to %s, "
                        "that sample runs again", self.predictions, len(data) - cut, aside.name)
            return len(data) - cut

    def records(self) -> list[dict[str, Any]]:
        """Every stored record, in file order (a retried sample's latest record wins in :meth:`latest`)."""
        records = []
        with suppress(FileNotFoundError), open(self.predictions, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                try:
                    records += [json.loads(line)] if line.endswith("\n") and line.strip() else []
                except ValueError as e:
                    raise OSError(f"{self.predictions}: line {i} is not a JSON record ({e}; edited by hand?); move it "
                                  "out of the file and rerun") from None
        return records

    def latest(self) -> dict[str, dict[str, Any]]:
        """``{sample id: its latest record}``."""
        return {r["id"]: r for r in self.records()}

    def done_ids(self) -> set[str]:
        """Ids of samples stored without an error (a failed sample is retried by the next run)."""
        return {i for i, r in self.latest().items() if r.get("error") is None}

    def append(self, record: dict[str, Any]) -> None:
        """Append a fsync-ed JSON line (ValueError: not strict JSON; OSError: the file is cut back)."""
        line = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode()
        with self.append_lock(), naming(self.predictions), open(self.predictions, "ab", buffering=0) as f:
            end = f.seek(0, os.SEEK_END)
            try:
                if f.write(line) != len(line):  # a full disk writes what fits, then fails
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(f.fileno())
            except OSError:
                f.truncate(end)
                raise

    def discard_if_empty(self) -> None:
        """Remove the folders this store made if no sample was stored; one another shard has opened is left alone."""
        if not self.made or self.predictions.exists() or any(self.path.glob(".lock.shard*")):  # (its own is gone)
            return
        for f in self.path.iterdir():
            f.unlink()
        for folder in self.made:
            folder.rmdir()

    def write_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as ``<folder>/<name>`` atomically."""
        atomic_write(self.path / name, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")
