"""Full-cache jobs of one setting that run at the same time compute each sample once.

The full cache keeps every token, so a ``method=full`` job computes the same predictions at
every budget; a paper preset's sweep (method × budget) holds one full-cache job per budget.
:func:`kvbench.job.reuse_full_cache_samples` copies what such sibling jobs stored *before* a job
starts; this module covers siblings that run *at the same time* (SLURM array tasks,
``hydra/launcher=parallel``), which would otherwise each compute every sample:

* before a sample, a job takes a *claim* on it: an ``flock`` on one of :data:`STRIPES` lock files
  in ``<task>/<model>/<method preset>/.full_claims/``, chosen by the prompt's SHA-256 (a lock
  file per sample would leave thousands of files; a lock taken by a killed process is released
  by the kernel). A sample whose claim another job holds is put off to the end of the run;
* holding the claim, the job first looks for the sample among the records its siblings have
  stored since it last looked (read incrementally: ``predictions.jsonl`` is append-only) and
  copies it (the record plus ``reused_from``, as the start-up copy does); only a sample that no
  sibling holds is computed, and its record is appended before the claim is released;
* the samples put off are then claimed waiting (a sibling is computing them, or another sample
  of the same stripe) and copied or computed the same way.

So N concurrent siblings share the work, and each sample is computed once. Full-cache jobs of
other settings in the same preset folder (another ``task.max_new_tokens``...) only contend for
the stripes: they never copy from one another (:func:`kvbench.job.full_cache_sibling`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Callable

#: Lock files (stripes) of one preset folder's claims.
STRIPES = 256
CLAIMS_DIR = ".full_claims"


def copied_record(rec: dict[str, Any], source: str, own: str) -> dict[str, Any]:
    """A sibling's record as this job stores its copy: ``reused_from`` names the job that computed
    it (``source``, or the job ``source`` copied it from), never this job (``own``) itself."""
    origin = rec.get("reused_from") or source
    return {**rec, "reused_from": source if origin == own else origin}


class FullCacheShare:
    """Claims and sibling records of one running full-cache job (see the module docstring).

    Args:
        store_path: this job's folder (its run lock held).
        root: ``output_root`` (absolute): ``reused_from`` is relative to it.
        wanted: ``{sample id: prompt SHA-256}`` of the samples this run may still need.
        is_sibling: whether a folder of the same preset folder is a full-cache job of this
            setting (called once per folder, when it holds records: its ``env.json`` is
            written with its first record).
    """

    def __init__(self, store_path: Path, root: Path, wanted: dict[str, str], is_sibling: Callable[[Path], bool]):
        self.path = Path(store_path)
        self.own = self.path.relative_to(root).as_posix()
        self.root = Path(root)
        self.wanted = dict(wanted)
        self.is_sibling = is_sibling
        self.claims = self.path.parent / CLAIMS_DIR
        self.claims.mkdir(exist_ok=True)
        self._read: dict[Path, int] = {}  # sibling folder -> bytes of its predictions.jsonl read so far
        self._others: set[Path] = set()  # folders that are not siblings
        self._found: dict[str, tuple[dict[str, Any], str]] = {}  # id -> (record, sibling folder relative to root)

    # --- claims ---------------------------------------------------------------------------
    def claim(self, sample_id: str, wait: bool) -> int | None:
        """Take the claim of a sample of :attr:`wanted` (its stripe: from its prompt's SHA-256): a
        file descriptor to pass to :meth:`release`, or None when ``wait`` is false and another
        process holds it."""
        stripe = int(self.wanted[sample_id][:8], 16) % STRIPES
        fd = os.open(self.claims / f"{stripe:03d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BaseException as e:  # KeyboardInterrupt while waiting, too
            os.close(fd)
            if isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    @staticmethod
    def release(fd: int) -> None:
        """Give a claim back (after the sample's record is stored)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # --- sibling records ------------------------------------------------------------------
    def copy_of(self, sample_id: str) -> dict[str, Any] | None:
        """A sibling's record of ``sample_id`` stored without error for this prompt, as this job
        stores a copy (``reused_from``: the job that computed it), or None."""
        self._refresh()
        hit = self._found.get(sample_id)
        if hit is None:
            return None
        return copied_record(*hit, self.own)

    def _refresh(self) -> None:
        """Read the records the sibling folders appended since the last call."""
        for folder in sorted(p for p in self.path.parent.iterdir()
                             if p.is_dir() and p != self.path and not p.name.startswith(".")):
            if folder in self._others:
                continue
            preds = folder / "predictions.jsonl"
            try:
                size = preds.stat().st_size
            except FileNotFoundError:
                continue
            if folder not in self._read:
                if not self.is_sibling(folder):
                    self._others.add(folder)
                    continue
                self._read[folder] = 0
            start = self._read[folder] if size >= self._read[folder] else 0
            if size == start:
                continue
            with open(preds, "rb") as f:
                f.seek(start)
                data = f.read(size - start)
            end = data.rfind(b"\n") + 1  # complete lines only: a line being written is read next time
            self._read[folder] = start + end
            source = folder.relative_to(self.root).as_posix()
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                    sid = str(rec["id"])
                except (ValueError, KeyError, TypeError):
                    continue
                if (sid in self.wanted and sid not in self._found and rec.get("error") is None
                        and rec.get("prompt_sha256") == self.wanted[sid]):
                    self._found[sid] = (rec, source)
