"""Glue between Hydra and the job runner: exit codes, logging, one-line errors."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from omegaconf import DictConfig, OmegaConf

from eval.base import TaskConfigError
from methods.base import ConfigError

from .job import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_TERMINATED, run_job
from .store import JobLockedError


class Terminated(KeyboardInterrupt):
    """SIGTERM in a single run (``kill PID``, ``scancel`` of a plain ``sbatch`` job): raised like
    Ctrl-C, so the job stops the same way (finished samples stored, nothing half-written kept)."""


def _raise_terminated(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Terminated()


def _on_sigterm() -> bool:
    """Turn SIGTERM into :class:`Terminated` in the main thread, unless a launcher owns the signal
    (submitit installs its own handlers for preemption and requeueing). Returns whether it did."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return False
    signal.signal(signal.SIGTERM, _raise_terminated)
    return True


def hydra_main(cfg: DictConfig) -> int:
    """Run the job Hydra composed. A single run exits the process with the job's exit code
    (0 ok, 1 failed samples, 2 configuration error, 3 locked, 130 interrupted, 143 terminated by SIGTERM);
    inside a sweep (-m) a failing job
    raises so that the launcher marks it failed, and the sweep goes on to the next job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        choice = hc.runtime.choices.get("method")
        experiment = hc.runtime.choices.get("experiment") or ""
        method_overrides = [o for o in hc.overrides.task if o.lstrip("+~").startswith("method.")]
    except ValueError:  # called outside Hydra (tests)
        multirun, choice, method_overrides, experiment = False, None, [], None
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "datasets", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    plain = OmegaConf.to_container(cfg, resolve=True)
    if not multirun:
        _on_sigterm()
    try:
        code = run_job(plain, choice, method_overrides, experiment)
    except (ConfigError, TaskConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_CONFIG
    except JobLockedError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_LOCKED
    except KeyboardInterrupt as e:
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"{what}: every finished sample is stored; rerun the same command to resume", file=sys.stderr, flush=True)
        code = EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    if multirun:
        if code != 0:
            raise RuntimeError(f"kvbench job failed with exit code {code}")
        return code
    sys.exit(code)
