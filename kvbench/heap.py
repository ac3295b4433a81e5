"""C-heap policy of a CPU job: freed tensor memory stays in the process for the next tensor.

A CPU prefill allocates and frees activations of tens of MB per layer (SmolLM2-135M at 2048
tokens: the MLP's gate/up product alone is 25 MB, thirty times). glibc's ``malloc`` serves a
block above its mmap threshold (128 KiB, raised as blocks are freed, to 32 MiB at most) with
fresh pages from the kernel and unmaps them on ``free``, and gives a freed heap top back to
the kernel above its trim threshold. Every prefill then faults in its activations again, page
by page: about 270 000 minor faults and 0.6 s of system time per 2048-token prefill of
SmolLM2-135M on 2 cores, measured with ``getrusage``; the prefill took 3.5–4.0 s with the
default and 3.2–3.4 s with :func:`keep_freed_heap` in alternating processes (2026-12-01).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

ENV = "KVBENCH_KEEP_HEAP"  # "0": leave glibc's malloc policy as it is
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
LIMIT_BYTES = 1 << 30  # blocks up to this size come from the heap; this much freed top is kept
_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_applied = False


def wanted() -> bool:
    """Whether ``KVBENCH_KEEP_HEAP`` asks for the policy (unset or empty: yes).

    Raises:
        ValueError: any other value than 1/true/yes/on or 0/false/no/off (case-insensitive),
            one line naming the variable and the accepted values.
    """
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("",) + _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: accepted values are 1/true/yes/on (the default) or "
                     "0/false/no/off (keep glibc's malloc policy)")


def in_effect() -> bool:
    """Whether :func:`keep_freed_heap` has applied the policy in this process (``env.json`` records it)."""
    return _applied


def keep_freed_heap(limit_bytes: int = LIMIT_BYTES) -> bool:
    """Serve blocks up to ``limit_bytes`` from the C heap and keep freed heap memory (glibc).

    Sets glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` (``mallopt(3)``) to
    ``limit_bytes``, so a tensor freed by one layer's prefill is reused by the next layer and
    the next sample without page faults (see the module docstring for the measured cost).
    Effect on memory: the peak resident memory is unchanged (it is the prefill's peak either
    way); between samples the resident set stays at that peak instead of falling back.
    ``malloc_trim(0)`` still returns the free pages (the benchmarks' memory workers call it
    before they measure). Process-wide; the first successful call applies it, later calls
    return True without calling glibc again.

    Args:
        limit_bytes: the largest block served from the heap and the freed heap top kept (bytes).

    Returns:
        True when the policy is in effect; False when ``KVBENCH_KEEP_HEAP`` turns it off
        (:func:`wanted`), the C library is not glibc (no ``mallopt``), or glibc refused the values.

    Raises:
        ValueError: ``KVBENCH_KEEP_HEAP`` has a value :func:`wanted` does not accept.
    """
    global _applied
    if not wanted():
        return False
    if _applied:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    value = min(int(limit_bytes), 2**31 - 1)
    if mallopt(_M_MMAP_THRESHOLD, value) != 1 or mallopt(_M_TRIM_THRESHOLD, value) != 1:
        log.debug("glibc mallopt refused %d bytes: malloc policy unchanged", value)
        return False
    _applied = True
    return True
