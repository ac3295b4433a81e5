"""The results store: one folder per job, one flushed JSON line per sample, resumable.

Layout and record schema: ``docs/RESULTS.md``. Guarantees:

* records are appended (never rewritten) under an exclusive ``flock`` and ``fsync``-ed, so
  shards of one job can share its folder and a ``kill -9`` loses at most the sample in flight;
* a truncated last line (a crash mid-write) is detected on open, moved aside to
  ``predictions.jsonl.partial-<time>`` and a run whose samples include that one computes it again;
* a process holds ``.lock.shard<k>`` for the whole run of shard k: a second process on the
  same shard waits up to ``lock_wait_s`` and then exits with a clear message;
* ``config.yaml``, ``env.json`` and ``summary.json`` are written atomically (temp file + rename);
  an existing ``config.yaml`` that differs is kept and the new one is saved beside it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .config_keys import METHOD_RUN_CONTROL_FIELDS
from .faults import crash_armed, crash_point

PREDICTIONS = "predictions.jsonl"
log = logging.getLogger(__name__)


class JobLockedError(RuntimeError):
    """Another process is running the same job shard."""


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file, fsync and rename (never a half-written file).

    Readers see either the old file or the new one. If anything fails before the rename (a full
    disk, a crash), the old file is left as it was and the temp file is removed (a ``kill -9``
    can leave a ``.<name>.tmp-<pid>`` file beside it, never a half ``<name>``).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        crash_point("atomic_write")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def try_lock_file(lock_path: Path) -> int | None:
    """Take an exclusive ``flock`` on ``lock_path`` (created if missing) without waiting, and
    write this process's pid into it (what a refused run names).

    Returns:
        The open file descriptor (the lock lasts until it is closed or the process ends), or
        None when another process holds the lock.

    Raises:
        OSError: the file cannot be opened, or ``flock`` fails for another reason.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fmt_budget(budget: Any) -> str:
    """``b<budget>``: a ratio as given (``b0.25``, ``b1.0``), a token budget as an integer
    (``budget=32`` and ``budget=32.0`` are the same 32-token budget: ``b32``)."""
    if isinstance(budget, float) and budget > 1.0 and budget.is_integer():
        budget = int(budget)
    elif isinstance(budget, float):
        budget = normalized_budget(budget)
    return f"b{budget}"


def normalized_budget(budget: Any) -> Any:
    """A float budget rounded to 12 significant digits (``range(0.1, 0.4, 0.1)`` yields
    0.30000000000000004: that is the ratio 0.3, its folder ``b0.3``); anything else unchanged."""
    if isinstance(budget, float) and math.isfinite(budget):
        return float(f"{budget:.12g}")
    return budget


def method_tag(method_overrides: list[str]) -> str:
    """Short hash of the ``method.*`` overrides given on the command line or by a sweep ('' if none)."""
    items = sorted(o.lstrip("+~") for o in method_overrides)
    if not items:
        return ""
    return hashlib.sha1("\n".join(items).encode()).hexdigest()[:8]


def _lookup(node: Any, dotted: str) -> tuple[bool, Any]:
    """``(found, value)`` of a dotted key in nested dicts."""
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def folder_method_overrides(overrides: list[str], method_cfg: dict, compose: Callable[[list[str]], Any]) -> list[str]:
    """The ``method.*`` overrides that name the job's folder: those that change the method config.

    An override that sets a key to the value the preset (and experiment) already give it, e.g.
    ``method.window_size=32`` on SelKV, computes the preset's own job, so it keeps the preset's
    folder (no hash) and resumes its samples; a W × K sweep's default point is therefore the
    main job, not a copy of it. A deletion (``~method.x``) or a key the preset lacks always counts.
    :data:`kvbench.config_keys.METHOD_RUN_CONTROL_FIELDS` (``method.kernel``) never count: they
    choose how the arithmetic runs, not what it computes.

    Args:
        overrides: the job's task overrides (command line or sweep), in Hydra's syntax.
        method_cfg: the job's resolved ``method`` node (overrides applied).
        compose: composes the config with a list of overrides (hydra node not needed); called
            once, with ``overrides`` less the ``method.*`` ones. When it raises, every
            ``method.*`` override counts (the folder name of earlier versions).
    """
    def field(o: str) -> str:  # "+method.sub.a=1" -> "sub.a"
        return o.lstrip("+~").split("=", 1)[0][len("method."):]

    method = [o for o in overrides if o.lstrip("+~").startswith("method.") and field(o) not in METHOD_RUN_CONTROL_FIELDS]
    if not method:
        return []
    try:
        from omegaconf import OmegaConf

        base = compose([o for o in overrides if o not in method])
        base_method = OmegaConf.to_container(OmegaConf.select(base, "method"), resolve=True)
    except Exception:  # noqa: BLE001 - no baseline: name the folder by every override
        return method
    kept = []
    for o in method:
        key = field(o)
        had, old = _lookup(base_method, key)
        has, new = _lookup(method_cfg, key)
        if o.startswith("~") or not has:
            kept.append(o)
        elif not had or old != new or isinstance(old, bool) != isinstance(new, bool):
            kept.append(f"method.{key}={_canonical(new, old if had else None)}")
    return list(dict.fromkeys(kept))


def _canonical(value: Any, reference: Any = None) -> str:
    """One spelling per value for the folder hash: ``method.alpha=2``, ``2.0`` and ``2e0`` on a
    float field are all ``2.0`` (an integer given for a float field counts as that float), ``16``
    stays ``16``, booleans ``true``/``false``, lists and mappings as compact JSON."""
    if isinstance(value, int) and not isinstance(value, bool) and isinstance(reference, float):
        value = float(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)


def job_relpath(cfg: dict, method_preset: str | None = None, method_overrides: list[str] | None = None) -> str:
    """``<task>/<model>/<method preset>/b<budget>[-<run_tag>][-<hash>]`` (or ``run_name``), see docs/RESULTS.md.

    Args:
        cfg: the resolved job config.
        method_preset: the ``conf/method`` file chosen (e.g. ``selkv_evict``); defaults to method.name.
        method_overrides: the ``method.*`` overrides of this job (command line or sweep); their hash
            keeps, e.g., the jobs of a W × K sweep apart.
    """
    if cfg.get("run_name"):
        return str(cfg["run_name"])
    parts = [_fmt_budget(cfg["budget"])]
    if cfg.get("run_tag"):
        parts.append(str(cfg["run_tag"]))
    tag = method_tag(method_overrides or [])
    if tag:
        parts.append(tag)
    method = method_preset or cfg["method"]["name"]
    return f"{cfg['task']['name']}/{cfg['model']['name']}/{method}/{'-'.join(parts)}"


STORE_FILES = ("predictions.jsonl", "summary.json", "config.yaml")
"""The files that make a folder a job folder (see docs/RESULTS.md)."""


def is_job_folder(folder: Path) -> bool:
    """Whether ``folder`` is a job folder: it holds ``config.yaml`` and ``predictions.jsonl`` or
    ``summary.json`` (what the report and the resume read as one job)."""
    return (folder / "config.yaml").is_file() and any((folder / n).exists() for n in STORE_FILES[:2])


def store_write_refusal(out: Path) -> str:
    """Why a command's output path ``out`` (a file or a folder) must not be written (``""`` when
    it may): it is a job's own file (``predictions.jsonl``, ``summary.json``, ``config.yaml``,
    ``env*.json``, ``config.*.yaml``) or lies inside a job folder. Writing there would replace
    stored samples or mix other files into a job (reports and resumes read the folder as one job).
    """
    out = Path(out).absolute()
    name = out.name
    if name in STORE_FILES or (name.startswith("env") and name.endswith(".json")) or \
            (name.startswith("config.") and name.endswith(".yaml")):
        return f"{name} is a job folder's own file (results store)"
    job = job_folder_around(out)
    return f"inside the job folder {job}" if job is not None else ""


def job_folder_around(path: Path) -> Path | None:
    """The job folder (:func:`is_job_folder`) that ``path`` is or lies in, else None."""
    return next((folder for folder in (path, *path.parents) if is_job_folder(folder)), None)


def output_file_refusal(out: Path, kind: str, is_kind: Callable[[Any], bool], default: str) -> str:
    """Why a command must not write its JSON output file ``out`` (``""`` when it may): ``out`` is
    a folder, a results-store path (:func:`store_write_refusal`), or an existing file whose JSON
    content fails ``is_kind`` (another kind of file: writing would replace it).

    Args:
        out: the output file.
        kind: what the command writes, for the message (``a scores file (a JSON object)``).
        is_kind: whether an existing file's parsed JSON is an earlier output of that kind.
        default: the command's default output, for the message (``DIR/result.json``).
    """
    if out.is_dir():
        return f"is a folder; pass a file path (default: {default})"
    why = store_write_refusal(out)
    if why:
        return why + "; pass a file outside the job folders"
    if out.exists():
        try:
            ok = is_kind(json.loads(out.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            ok = False
        if not ok:
            return f"exists and is not {kind}; pass a new file"
    return ""


def replace_keeping(path: Path, text: str) -> Path | None:
    """Write ``text`` to ``path`` atomically (:func:`atomic_write`) after keeping an earlier,
    different file there beside it (:func:`keep_previous`).

    Returns:
        The kept copy's path, or None when there was no earlier file or it held ``text``.

    Raises:
        OSError: the folder cannot be written (nothing is replaced).
    """
    kept = keep_previous(path, replacing=text)
    atomic_write(path, text)
    return kept


def keep_previous(path: Path, replacing: str | None = None) -> Path | None:
    """Copy an existing file ``path`` to ``<stem>.<time><suffix>`` beside it (the time it was
    last written; ``-2``, ``-3``... within one second, never overwriting) before a new run
    replaces it, so that no earlier output is lost.

    Args:
        path: the file about to be replaced.
        replacing: the new text, when known: a file that already holds it is not copied.

    Returns:
        The copy's path (an identical earlier copy is reused), or None if ``path`` is absent
        or already holds ``replacing``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    except FileNotFoundError:
        return None
    if text == replacing:
        return None
    snapshot, n = path.with_name(f"{path.stem}.{stamp}{path.suffix}"), 1
    while snapshot.exists():
        if snapshot.read_text(encoding="utf-8", errors="replace") == text:
            return snapshot  # kept already
        n += 1
        snapshot = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
    atomic_write(snapshot, text)
    return snapshot


class JobStore:
    """One job folder.

    Args:
        path: the job folder (created if absent).
        shard: ``(index, count)`` of this process.
    """

    def __init__(self, path: Path | str, shard: tuple[int, int] = (0, 1)):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.shard = shard
        self.predictions = self.path / PREDICTIONS
        self._lock_fd: int | None = None
        self._with_first_record: dict[str, Any] = {}

    # --- locking ------------------------------------------------------------------------
    def acquire(self, wait_s: float = 0.0) -> None:
        """Take this shard's run lock.

        Raises:
            JobLockedError: still held by another process after ``wait_s`` seconds.
        """
        lock_path = self.path / f".lock.shard{self.shard[0]}-of-{self.shard[1]}"
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = try_lock_file(lock_path)
            except OSError:  # not a lock held elsewhere: no point in waiting
                fd, deadline = None, 0.0
            if fd is not None:
                break
            if time.monotonic() >= deadline:
                holder = lock_path.read_text(errors="replace").strip() or "?"
                waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
                raise JobLockedError(
                    f"job folder {self.path} (shard {self.shard[0]} of {self.shard[1]}) is in use by process "
                    f"{holder}{waited}; wait for it to finish or "
                    + (f"set a longer lock_wait_s (now {wait_s:g})" if wait_s > 0 else "set lock_wait_s=SECONDS to wait")
                ) from None
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def discard_if_empty(self, created: Path) -> bool:
        """Remove this job folder, and its parents up to ``created``, when it holds nothing but
        this shard's lock file and the append lock: what a run refused before storing anything
        leaves behind in a folder it created. Call it with the lock held; anything else in the
        folder (another shard's lock, a config, records) keeps it.

        Args:
            created: the highest folder this run created (the job folder or one of its parents).

        Returns:
            True when the job folder was removed.
        """
        mine = {f".lock.shard{self.shard[0]}-of-{self.shard[1]}", ".append.lock"}
        try:
            if any(p.name not in mine for p in self.path.iterdir()):
                return False
            for name in mine:
                (self.path / name).unlink(missing_ok=True)
            folder = self.path
            while True:
                folder.rmdir()  # OSError when not empty (another job made a folder there meanwhile)
                if folder == created:
                    return True
                folder = folder.parent
        except OSError:
            return not self.path.exists()

    def other_shards_running(self) -> bool:
        """Whether another process holds a shard lock of this folder (another shard, or a run
        with another ``shard.count``), tested without blocking."""
        mine = f".lock.shard{self.shard[0]}-of-{self.shard[1]}"
        for lock in self.path.glob(".lock.shard*"):
            if lock.name == mine:
                continue
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                return True
            finally:
                os.close(fd)
        return False

    @contextmanager
    def locked(self, wait_s: float = 0.0) -> Iterator["JobStore"]:
        self.acquire(wait_s)
        try:
            yield self
        finally:
            self.release()

    @contextmanager
    def _append_lock(self) -> Iterator[None]:
        fd = os.open(self.path / ".append.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def clean_stale_temp(self, max_age_s: float = 600.0) -> list[str]:
        """Delete temp files of :func:`atomic_write` left by a killed process (older than ``max_age_s``).

        A temp file lives for milliseconds; an old one belongs to a process killed between write
        and rename (its target file is intact). Age, not the pid, decides: shards on other hosts
        of a shared file system have pids this host cannot see. Returns the names deleted.
        """
        now, gone = time.time(), []
        for tmp in self.path.glob(".*.tmp-*"):
            try:
                if now - tmp.stat().st_mtime > max_age_s:
                    tmp.unlink()
                    gone.append(tmp.name)
            except FileNotFoundError:
                continue
        return gone

    # --- records ------------------------------------------------------------------------
    def repair(self) -> int:
        """Move a truncated last line aside (crash mid-write). Returns the bytes moved (0 if none).

        The bytes are kept in ``predictions.jsonl.partial-<ms>``; the sample they belonged to has
        no complete record, so a resumed run redoes it.
        """
        if not self.predictions.exists():
            return 0
        with self._append_lock():
            return self._repair_locked()

    def _repair_locked(self) -> int:
        """:meth:`repair` for a caller that holds the append lock."""
        try:
            size = self.predictions.stat().st_size
        except FileNotFoundError:
            return 0
        if size == 0:
            return 0
        with open(self.predictions, "rb") as f:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0  # the common case: one byte read per append
            f.seek(0)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        partial = self.path / f"{PREDICTIONS}.partial-{int(time.time() * 1000)}"
        with open(partial, "wb") as f:
            f.write(data[cut:])
            f.flush()
            os.fsync(f.fileno())
        with open(self.predictions, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        log.warning(
            "%s ended with a truncated record (%d bytes, a crash mid-write); moved to %s; a run whose samples include it computes it again",
            self.predictions, len(data) - cut, partial.name,
        )
        return len(data) - cut

    def records(self) -> list[dict[str, Any]]:
        """All complete records, the last one per sample id (a retried failure replaces its error).

        Lines that are not valid records (only possible if the file was edited by hand: appends
        never glue a record to a truncated line) are skipped with a warning.
        """
        if not self.predictions.exists():
            return []
        latest: dict[str, dict] = {}
        bad = 0
        with open(self.predictions, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # truncated tail: repair() moves it aside
                try:
                    rec = json.loads(line)
                    latest[str(rec["id"])] = rec
                except (json.JSONDecodeError, KeyError, TypeError):
                    bad += 1
        if bad:
            log.warning("%s: %d line(s) are not valid records and were ignored (edited by hand?)", self.predictions, bad)
        return list(latest.values())

    def done_ids(self) -> set[str]:
        """Ids of samples stored without error (skipped on resume)."""
        return {r["id"] for r in self.records() if r.get("error") is None}

    def append(self, record: dict[str, Any]) -> None:
        """Append one record as one line, flushed and fsync-ed, under the append lock.

        A truncated last line left by a process killed mid-write (possibly another shard's) is
        moved aside first, so that the new record never gets glued to it.

        Raises:
            ValueError / TypeError: the record holds NaN/inf or a value JSON cannot encode
                (nothing is written).
        """
        line = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        for name in list(self._with_first_record):  # metadata of the records this run stores
            self._keep_previous(name)
            self.write_json(name, self._with_first_record.pop(name))
        with self._append_lock():
            self._repair_locked()
            with open(self.predictions, "ab") as f:
                if crash_armed("append"):
                    f.write(line[: len(line) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                    crash_point("append")
                    f.write(line[len(line) // 2 :])
                else:
                    f.write(line)
                f.flush()
                os.fsync(f.fileno())

    # --- metadata -----------------------------------------------------------------------
    def write_config(self, text: str, same: Callable[[str], bool] | None = None) -> Path:
        """Write ``config.yaml``; if a different one is stored, keep it and write ``config.<time>.yaml``.

        A run whose config equals a stored ``config.<time>.yaml`` (a changed grid run again, or
        two grids run in turn) writes nothing new; the summary's ``selection`` says which ran last.

        Args:
            text: the job's resolved config as YAML.
            same: optional test of the stored text; when it returns True the stored file is
                kept as is (default: byte equality with ``text``).
        """
        path = self.path / "config.yaml"
        if path.exists():
            stored = path.read_text(encoding="utf-8")
            if stored == text or (same is not None and same(stored)):
                return path
            for snapshot in sorted(self.path.glob("config.*.yaml"), reverse=True):  # newest first
                older = snapshot.read_text(encoding="utf-8", errors="replace")
                if older == text or (same is not None and same(older)):
                    return snapshot
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = self.path / f"config.{stamp}.yaml"
            n = 1
            while path.exists():  # another config within the same second: never overwrite one
                n += 1
                path = self.path / f"config.{stamp}-{n}.yaml"
        atomic_write(path, text)
        return path

    def _keep_previous(self, name: str) -> None:
        """Copy a stored ``name`` (an earlier run's ``env.json``) to ``<stem>.<time>.json`` before
        this run replaces it (:func:`keep_previous`): the provenance of every run that stored
        samples stays in the folder."""
        keep_previous(self.path / name)

    def write_json_with_first_record(self, name: str, obj: Any) -> None:
        """Write ``name`` (as :meth:`write_json`) just before this object's next record is
        appended, so that it describes stored samples: a run that stores nothing (it failed
        before its first sample, or had nothing to do) leaves the stored file as it was. A
        stored ``name`` of an earlier run is kept as ``<stem>.<time>.json`` first."""
        self._with_first_record[name] = obj

    def write_json(self, name: str, obj: Any) -> None:
        """Atomically write ``name`` as indented JSON."""
        atomic_write(self.path / name, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")
