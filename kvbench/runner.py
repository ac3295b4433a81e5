"""Glue between Hydra and the job runner: exit codes, logging, one-line errors."""

from __future__ import annotations

import logging
import sys

from omegaconf import DictConfig, OmegaConf

from eval.base import TaskConfigError
from methods.base import ConfigError

from .job import EXIT_CONFIG, EXIT_LOCKED, run_job
from .signals import EXIT_INTERRUPTED, EXIT_TERMINATED, stop_code, stop_message
from .store import JobLockedError, folder_method_overrides, job_relpath
from .sweep_ledger import collect, record


#: ``(job folder, exit code)`` of every job this process ran in a local sweep (Hydra's basic
#: launcher runs them one after another in this process); read by :func:`finish_sweep`.
SWEEP_JOBS: list[tuple[str, int]] = []

_EXIT_MEANING = {1: "some samples failed (stored with their error; rerun to retry them)",
                 EXIT_CONFIG: "configuration error", EXIT_LOCKED: "job locked by another process"}


def _local_sweep(hc) -> bool:
    """Whether this multirun job runs in Hydra's basic launcher (``hydra/launcher=local``): in this
    process, one job after another, so that a signal here is the user's and stops the sweep."""
    return str(OmegaConf.select(hc, "launcher._target_", default="")).endswith("BasicLauncher")


def _job_name(cfg: dict, choice: str | None, method_overrides: list[str]) -> str:
    """The job's folder under ``output_root`` (its name in the results store), for messages."""
    try:
        return job_relpath(cfg, choice, method_overrides)
    except Exception:  # noqa: BLE001 - a config too broken for a folder name: name it by its method and budget
        return f"method={OmegaConf.select(OmegaConf.create(cfg), 'method.name')} budget={cfg.get('budget')}"


def _compose(config_name: str):
    """Hydra's compose API for this run's config (inside the running app, or in a process that
    has not initialized Hydra: the project's ``conf/``), for :func:`folder_method_overrides`."""
    def compose(overrides: list[str]):
        from hydra import compose as hydra_compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        if GlobalHydra.instance().is_initialized():
            return hydra_compose(config_name, overrides=overrides)
        from .cli_guard import CONF

        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose(config_name, overrides=overrides)

    return compose


def finish_sweep() -> int:
    """After a sweep: one line per job that did not exit 0, and the sweep's exit code (0 when
    every job did, else the largest job exit code). The jobs are those this process ran (local
    launcher, :data:`SWEEP_JOBS`) and those that ran elsewhere and left their exit code in the
    sweep's ledger (parallel and SLURM launchers, :mod:`kvbench.sweep_ledger`). 0 when no sweep ran."""
    jobs = SWEEP_JOBS + collect()
    failed = [(job, code) for job, code in jobs if code != 0]
    for job, code in failed:
        print(f"error: sweep job {job} exited {code}: {_EXIT_MEANING.get(code, 'failed')}", file=sys.stderr, flush=True)
    if failed:
        fix = "fix the configuration errors above, then " if any(code == EXIT_CONFIG for _, code in failed) else ""
        print(f"sweep: {len(failed)} of {len(jobs)} jobs did not finish cleanly; {fix}rerun the same command "
              "to retry them (finished jobs are skipped)", file=sys.stderr, flush=True)
    return max((code for _, code in failed), default=0)


def hydra_main(cfg: DictConfig) -> int:
    """Run the job Hydra composed. A single run exits the process with the job's exit code
    (0 ok, 1 failed samples, 2 configuration error, 3 locked, 130 interrupted, 143 terminated by SIGTERM).

    Inside a sweep (-m): with the local launcher a job's exit code is kept for
    :func:`finish_sweep` (``run.py`` prints one line per failed job when the sweep ends), and
    Ctrl-C or SIGTERM stops the whole sweep with 130/143 after the running job stored its
    finished samples; with other launchers (SLURM, joblib) every job writes its exit code into
    the sweep's ledger (:mod:`kvbench.sweep_ledger`) for :func:`finish_sweep` in the submitting
    process, and returns it; without a ledger (a sweep not started by ``run.py``) a failing job
    raises so that the launcher marks it failed.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    local, job_num = False, 0
    try:
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        local = multirun and _local_sweep(hc)
        job_num = int(OmegaConf.select(hc, "job.num", default=0) or 0)
        choice = hc.runtime.choices.get("method")
        experiment = hc.runtime.choices.get("experiment") or ""
        method_overrides = folder_method_overrides(list(hc.overrides.task), OmegaConf.to_container(
            cfg.method, resolve=True) if "method" in cfg else {}, _compose(hc.job.config_name or "config"))
    except ValueError:  # called outside Hydra (tests)
        multirun, choice, method_overrides, experiment = False, None, [], None
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "datasets", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    plain = OmegaConf.to_container(cfg, resolve=True)
    try:
        code = run_job(plain, choice, method_overrides, experiment)
    except (ConfigError, TaskConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_CONFIG
    except JobLockedError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_LOCKED
    except KeyboardInterrupt as e:
        print(stop_message(e), file=sys.stderr, flush=True)
        code = stop_code(e)
    if local:
        if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            raise SystemExit(code)  # the user stopped the sweep, not just this job (Hydra lets SystemExit through)
        SWEEP_JOBS.append((_job_name(plain, choice, method_overrides), code))
        return code
    if multirun:
        if not record(job_num, _job_name(plain, choice, method_overrides), code) and code != 0:
            raise RuntimeError(f"kvbench job failed with exit code {code}")
        return code
    sys.exit(code)
