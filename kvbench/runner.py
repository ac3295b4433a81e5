"""Glue between Hydra and the job runner: exit codes, logging, one-line errors."""

from __future__ import annotations

import logging
import sys
from omegaconf import DictConfig, OmegaConf

from eval.base import TaskConfigError
from methods.base import ConfigError

from .job import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_LOCKED, run_job
from .store import JobLockedError



def hydra_main(cfg: DictConfig) -> int:
    """Run the job Hydra composed. A single run exits the process with the job's exit code
    (0 ok, 1 failed samples, 2 configuration error, 3 locked, 130 interrupted); inside a sweep (-m) a failing job
    raises so that the launcher marks it failed, and the sweep goes on to the next job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        choice = hc.runtime.choices.get("method")
        method_overrides = [o for o in hc.overrides.task if o.lstrip("+~").startswith("method.")]
    except ValueError:  # called outside Hydra (tests)
        multirun, choice, method_overrides = False, None, []
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "datasets", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    plain = OmegaConf.to_container(cfg, resolve=True)
    try:
        code = run_job(plain, choice, method_overrides)
    except (ConfigError, TaskConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_CONFIG
    except JobLockedError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_LOCKED
    except KeyboardInterrupt:
        print("interrupted: every finished sample is stored; rerun the same command to resume", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    if multirun:
        if code != 0:
            raise RuntimeError(f"kvbench job failed with exit code {code}")
        return code
    sys.exit(code)
