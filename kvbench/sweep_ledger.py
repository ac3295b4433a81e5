"""Exit codes of a sweep's jobs that run in other processes (``hydra/launcher=parallel``: joblib
worker processes; ``hydra/launcher=slurm``: SLURM array tasks), so that the sweep ends as a
local one does: one line per failed job and the largest exit code (``kvbench.runner.finish_sweep``).

Hydra's own way, a job that raises, ends such a sweep with a traceback of the first failed
job and exit code 1, and says nothing of the others. Instead:

* :class:`SweepLedger` (a Hydra callback, ``conf/config.yaml`` ``hydra.callbacks``) names a fresh
  folder ``<hydra.sweep.dir>/.exit_codes/<start time>-<pid>/`` when a sweep starts and passes its
  path to the jobs in ``$KVBENCH_SWEEP_LEDGER`` (worker processes and ``sbatch`` inherit the
  environment; the sweep folder is on the file system the SLURM tasks share with the submitter,
  as submitit's own files are);
* each job writes ``job<num>.json`` (its folder name and exit code) there, atomically;
* the submitting process reads them when the launcher returns.

Standard library and Hydra only: Hydra imports this module in the submitting process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

#: Environment variable naming the ledger folder of the running sweep.
LEDGER_ENV = "KVBENCH_SWEEP_LEDGER"


class SweepLedger(Callback):
    """Hydra callback: a fresh ledger folder per sweep (see the module docstring)."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Export the path ``<hydra.sweep.dir>/.exit_codes/<YYYYmmdd-HHMMSS>-<pid>/`` (made by the
        first job that records: a local sweep, whose jobs run in this process, leaves none)."""
        folder = Path(str(config.hydra.sweep.dir)).resolve() / ".exit_codes" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.environ[LEDGER_ENV] = str(folder)
        # A parallel sweep stopped by Ctrl-C leaves its queues' semaphores to the resource tracker
        # process, which removes them and warns about each on stderr after run.py's one stop line.
        quiet = "ignore:resource_tracker:UserWarning"
        if quiet not in os.environ.get("PYTHONWARNINGS", ""):
            os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))


def record(job_num: int, job: str, code: int) -> bool:
    """Write one job's exit code into the running sweep's ledger (``job<num>.json``, written to a
    temporary name and renamed, so a reader never sees half a file).

    Returns:
        False when no ledger is set (a sweep not started by ``run.py`` with the callback).
    """
    folder = os.environ.get(LEDGER_ENV)
    if not folder:
        return False
    path = Path(folder) / f"job{int(job_num)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"num": int(job_num), "job": job, "code": int(code)}))
    os.replace(tmp, path)
    return True


def collect() -> list[tuple[str, int]]:
    """``(job folder, exit code)`` of every job that recorded one, in job order, and forget the
    ledger (unset ``$KVBENCH_SWEEP_LEDGER``). ``[]`` when no ledger is set."""
    folder = os.environ.pop(LEDGER_ENV, None)
    if not folder or not Path(folder).is_dir():
        return []
    entries = []
    for path in Path(folder).glob("job*.json"):
        try:
            data = json.loads(path.read_text())
            entries.append((int(data["num"]), str(data["job"]), int(data["code"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a file another tool left there: not a job's record
    return [(job, code) for _num, job, code in sorted(entries)]
