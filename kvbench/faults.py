"""Failure injection for reliability tests, driven by environment variables (inert unless set).

``KVBENCH_FAIL_SAMPLES=id[:kind],...``
    Make these samples fail inside :func:`kvbench.runner.run_sample`. ``kind`` is ``error``
    (default: a ``RuntimeError``), ``oom`` (a ``torch.OutOfMemoryError``) or ``nan`` (the
    model's output logits are replaced by NaN for that sample, so that the engine's
    non-finite-logits check is what fails it).
``KVBENCH_CRASH_AT=point:n``
    ``SIGKILL`` this process the n-th time (1-based) it passes ``point``:
    ``append`` (half of a record line written and fsync-ed, the rest never),
    ``atomic_write`` (the temporary file written, not yet renamed),
    ``sample`` (before generating a sample).
``KVBENCH_SAMPLE_DELAY_S=seconds``
    Sleep this long before computing each sample (a slow model), so that jobs started together
    are still running together (``tests/kvbench/test_reuse_full.py``).

Used by ``tests/kvbench/test_crash.py`` and ``tests/kvbench/test_isolation.py`` through the
real command line; see docs/RELIABILITY.md.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Any, Iterator

FAIL_ENV = "KVBENCH_FAIL_SAMPLES"
CRASH_ENV = "KVBENCH_CRASH_AT"
DELAY_ENV = "KVBENCH_SAMPLE_DELAY_S"
FAIL_KINDS = ("error", "oom", "nan")

_passes: dict[str, int] = {}


class InjectedFailure(RuntimeError):
    """A failure injected with ``KVBENCH_FAIL_SAMPLES`` (kind ``error``)."""


def failure_for(sample_id: str) -> str | None:
    """The injected failure kind for ``sample_id`` (``error``, ``oom``, ``nan``) or None."""
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return None
    for item in spec.split(","):
        sid, _, kind = item.strip().partition(":")
        if sid == sample_id:
            return kind or "error"
    return None


@contextmanager
def injected(sample_id: str, model: Any) -> Iterator[None]:
    """Apply the failure injected for ``sample_id`` (if any) around its generation.

    Raises:
        InjectedFailure: kind ``error``.
        torch.OutOfMemoryError: kind ``oom``.
    """
    kind = failure_for(sample_id)
    if kind is None:
        yield
        return
    if kind == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected out-of-memory error for sample {sample_id}")
    if kind == "nan":
        import torch

        head = model.get_output_embeddings()
        handle = head.register_forward_hook(lambda mod, args, out: torch.full_like(out, float("nan")))
        try:
            yield
        finally:
            handle.remove()
        return
    raise InjectedFailure(f"injected failure for sample {sample_id} ({FAIL_ENV})")


def sample_delay() -> None:
    """Sleep ``KVBENCH_SAMPLE_DELAY_S`` seconds (before a sample is computed), if set."""
    delay = os.environ.get(DELAY_ENV)
    if delay:
        import time

        time.sleep(float(delay))


def crash_armed(point: str) -> bool:
    """Whether ``KVBENCH_CRASH_AT`` names ``point`` (the caller then prepares a partial state)."""
    return os.environ.get(CRASH_ENV, "").partition(":")[0] == point


def crash_point(point: str) -> None:
    """``SIGKILL`` the process if ``KVBENCH_CRASH_AT`` names this point and pass number."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    name, _, n = spec.partition(":")
    if name != point:
        return
    _passes[point] = _passes.get(point, 0) + 1
    if _passes[point] == int(n or 1):
        os.kill(os.getpid(), signal.SIGKILL)
