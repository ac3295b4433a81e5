"""Build a C kernel library on first use, cached per source, flags, compiler and CPU.

Shared by :mod:`kvbench.cpu_decode` (the decode step's matrix-vector products and attention)
and :mod:`methods.cpu_kernels` (LOOK-M's quadratic steps). The library goes to
``$KVBENCH_CACHE_DIR/kernels`` (default ``~/.cache/kvbench/kernels``), named
``<stem>-<hash>.so`` after a hash of the source, the flags, the compiler's version and the
CPU's feature flags (a cache shared by machines of different CPUs keeps one library per CPU);
it is written to a temporary name and renamed, so concurrent jobs never load a half-written
file. A cache folder that cannot be created gives a warning and ``$TMPDIR/kvbench-kernels-<uid>``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """``$KVBENCH_CACHE_DIR/kernels`` (default ``~/.cache/kvbench/kernels``)."""
    base = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(base) / "kernels"


def cpu_flags() -> str:
    """The CPU's feature-flag line from ``/proc/cpuinfo`` (part of the library's name hash)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def build(source: Path, flags: tuple[str, ...], link: tuple[str, ...], libs: tuple[str, ...], label: str) -> Path:
    """Compile ``source`` with ``$CC`` (default ``cc``) into the kernel cache, or reuse the cached build.

    Two steps: ``cc <flags> -c source`` then ``cc <link> -o lib.so obj <libs>`` (link flags
    apart, e.g. without ``-ffast-math``, which would link GCC's ``crtfastmath.o`` and turn on
    flush-to-zero for the whole process when the library loads).

    Args:
        source: the C file; flags, link, libs: compiler arguments; label: what the library is,
            for log lines (e.g. "the LOOK-M CPU kernels").

    Returns:
        The library's path.

    Raises:
        OSError: no compiler, or the compiler failed (its last output lines in the message).
    """
    compiler = os.environ.get("CC") or "cc"
    exe = shutil.which(compiler)
    if exe is None:
        where = "does not exist or is not executable" if os.sep in compiler else "is not on PATH"
        raise OSError(f"no C compiler ({compiler!r} {where}; set CC)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([source.read_text(encoding="utf-8"), *flags, *link, *libs, version, cpu_flags()])
                         .encode()).hexdigest()[:16]
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fallback = Path(tempfile.gettempdir()) / f"kvbench-kernels-{os.getuid()}"
        log.warning("kernel cache %s is not writable (%s): building %s in %s",
                    folder, exc.strerror or exc, label, fallback)
        folder = fallback
        folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in ([exe, *flags, "-c", "-o", obj, str(source)], [exe, *link, "-o", tmp, obj, *libs]):
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                tail = " | ".join((run.stderr or run.stdout).strip().splitlines()[-3:])
                raise OSError(f"{compiler} failed on {source.name} (exit {run.returncode}): {tail}")
        os.replace(tmp, target)  # atomic: a concurrent job loads a whole file or builds its own
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    log.info("built %s: %s", label, target)
    return target


class Library:
    """A compiled kernel library, loaded once per process, or the one-line reason it cannot be.

    Args:
        label: what the library is, for messages (e.g. "LOOK-M CPU kernels").
        open_library: builds and opens it, returning the object callers use; raises
            ``OSError``/``subprocess.SubprocessError`` when it cannot (the message is the reason).
        fallback: what the callers do without it, for the one log line (e.g. "using PyTorch operations").
        level: that line's logging level.

    ``loaded`` and ``reason`` hold the outcome (tests set them to simulate either).
    """

    def __init__(self, label: str, open_library: Callable[[], Any], fallback: str, level: int = logging.WARNING):
        self.label, self.open_library, self.fallback, self.level = label, open_library, fallback, level
        self.loaded: Any = None
        self.reason: str | None = None
        self.told = False
        self._lock = threading.Lock()

    def get_quietly(self) -> Any:
        """The library (opened on the first call), or None with :attr:`reason` set."""
        if self.loaded is not None or self.reason is not None:
            return self.loaded
        with self._lock:
            if self.loaded is None and self.reason is None:
                try:
                    self.loaded = self.open_library()
                except (OSError, subprocess.SubprocessError) as exc:
                    self.reason = str(exc)
            return self.loaded

    def get(self) -> Any:
        """:meth:`get_quietly`; the first None also logs ``<label> unavailable, <fallback>: <reason>`` once."""
        lib = self.get_quietly()
        if lib is None and not self.told:
            self.told = True
            log.log(self.level, "%s unavailable, %s: %s", self.label, self.fallback, self.reason)
        return lib
