"""``hydra/launcher=local`` (the default): a sweep on this machine, in this process.

The task function (:func:`kvbench.job.run.main`) only checks each job here: a bad value in any job stops the sweep
(one line, exit 2) before a model loads. Then :func:`kvbench.job.run.run_sweep` runs them and the process ends with
the largest exit code (Hydra's multirun returns no value to ``run.py``).
"""

from __future__ import annotations

import sys

from hydra._internal.core_plugins.basic_launcher import BasicLauncher


class LocalLauncher(BasicLauncher):
    def launch(self, job_overrides, initial_job_idx):  # noqa: ANN001, ANN201 - Hydra's Launcher API
        from kvbench.job.run import run_sweep

        jobs = [r.return_value for r in super().launch(job_overrides, initial_job_idx)]
        for error in (j for j in jobs if isinstance(j, Exception)):
            raise error  # the first bad job's one line (run.py), exit 2
        sys.exit(run_sweep(jobs))
