"""Ctrl-C and SIGTERM as one clean stop: one line, exit code 130 or 143, nothing lost.

Two modes, switched by the job (standard library only, so ``run.py`` can set the first before
importing Hydra or torch):

* :func:`stop_at_once` (start-up, model load, between the jobs of a local sweep, after the
  last): print the line and exit at once. Nothing is half-written there that a ``kill -9``
  would not also leave safely (the results store is kill-safe: atomic files, ``flock``), and an
  exception raised inside a library's import or loading code may be caught and re-raised as
  another error (transformers' lazy imports turn it into ``ModuleNotFoundError``).
* :func:`stops_by_exception` (while samples run, :func:`kvbench.job._loop`): raise
  ``KeyboardInterrupt`` / :class:`Terminated` so the job finishes writing the current record
  boundary cleanly and its caller prints the line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `yes | head`
STOP_HINT = "every finished sample is stored; rerun the same command to resume"


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill PID``, ``scancel`` of a plain ``sbatch`` job): raised like Ctrl-C, so the
    job stops the same way (finished samples stored, nothing half-written kept)."""


def _raise_terminated(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Terminated()


def stop_message(err: KeyboardInterrupt) -> str:
    """The one line printed for a stop: ``interrupted: …`` or ``terminated (SIGTERM): …``."""
    return f"{'terminated (SIGTERM)' if isinstance(err, Terminated) else 'interrupted'}: {STOP_HINT}"


def stop_code(err: KeyboardInterrupt) -> int:
    """130 for Ctrl-C, 143 for SIGTERM."""
    return EXIT_TERMINATED if isinstance(err, Terminated) else EXIT_INTERRUPTED


_raised_for_workers = False


def _loky_executor():
    """joblib's reusable loky executor when this process started one (``hydra/launcher=parallel``), else None."""
    return getattr(sys.modules.get("joblib.externals.loky.reusable_executor"), "_executor", None)


def _exit_now(signum, frame):  # noqa: ARG001 - signal handler signature
    global _raised_for_workers
    err = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
    if _loky_executor() is not None and not _raised_for_workers:
        # a parallel sweep's parent waits in joblib, whose own Ctrl-C path stops the workers and
        # removes its temporary files; run.py then prints the line (a second signal exits at once)
        _raised_for_workers = True
        raise err
    os.write(2, (stop_message(err) + "\n").encode())
    stop_workers()
    os._exit(stop_code(err))


def stop_workers(grace_s: float = 3.0) -> list[int]:
    """Stop the worker processes this process started for a parallel sweep (joblib's loky
    executor, ``hydra/launcher=parallel``) before it exits at once (a second Ctrl-C/SIGTERM; the
    first one goes through joblib's own abort, see :func:`_exit_now`): each gets SIGINT (it
    stops between whole records), then the executor's shutdown sentinel, and after ``grace_s``
    seconds SIGKILL if still there (the store is kill-safe). Without this an interrupted sweep
    left its workers behind, blocked on the dead parent's queue, each holding a model in memory.

    Returns:
        The pids signalled (``[]`` when no loky executor was started).
    """
    executor = _loky_executor()
    pids = [int(pid) for pid in list(getattr(executor, "_processes", None) or {})]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGINT)
    with contextlib.suppress(Exception):  # then the executor's sentinels: idle workers exit cleanly
        executor.shutdown(wait=False)
    alive, deadline = set(pids), time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    alive.discard(pid)
            except ChildProcessError:  # not our child (already reaped)
                alive.discard(pid)
        time.sleep(0.05)
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return pids


def stop_at_once() -> None:
    """Ctrl-C and SIGTERM print the stop line and exit at once (main thread only; SIGTERM left to a
    launcher that installed its own handler, e.g. submitit). In the parent of a parallel sweep the
    first one raises instead, so that joblib stops its workers (:func:`_exit_now`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _exit_now)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # else a launcher's own handler
        signal.signal(signal.SIGTERM, _exit_now)


@contextlib.contextmanager
def stops_by_exception() -> Iterator[None]:
    """Inside the block (the sample loop) Ctrl-C raises ``KeyboardInterrupt`` and SIGTERM
    :class:`Terminated`, so the job stops between whole records, where :func:`stop_at_once` is in
    force (``run.py``); the handlers from before the block are restored after it. Elsewhere (a
    launcher's worker process, another thread) the block runs with the handlers it has.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not _exit_now:
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if before[signal.SIGTERM] is _exit_now:  # not a launcher's own handler
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def quiet_broken_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command's ``main`` so that a reader that closes its end early (``kvbench report
    --help | head``) ends it quietly with exit code 141 (128 + SIGPIPE), as a shell tool, instead
    of a ``BrokenPipeError`` traceback. Standard output is flushed inside the wrapper (a pipe may
    break on the last flush) and then pointed at ``/dev/null`` so that the interpreter's own
    flush at exit stays silent."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE

    return wrapper


def one_line_stop(kept: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a tool's ``main`` (latency, mask-heads, benchmarks, calibration) so that Ctrl-C ends
    it with one line, ``interrupted: <kept>``, and exit code 130 (143 for :class:`Terminated`)
    instead of a ``KeyboardInterrupt`` traceback. While ``main`` runs, SIGTERM (when its handler
    is the default one) raises :class:`Terminated`: the same line, ``terminated (SIGTERM): ...``.

    Args:
        kept: what of the run is kept, for the message (``nothing was written``...).
    """

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapper(*args, **kwargs) -> int:
            # SIGTERM (kill, a scheduler's stop) ends it the same way, not silently with the default action
            term = threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
            if term:
                signal.signal(signal.SIGTERM, _raise_terminated)
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt as err:
                word = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
                print(f"\n{word}: {kept}", file=sys.stderr, flush=True)
                return stop_code(err)
            finally:
                if term:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)

        return wrapper

    return wrap
