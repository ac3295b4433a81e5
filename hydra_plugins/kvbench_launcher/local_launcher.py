"""``hydra/launcher=local``: check every job of the sweep first, then run them (:func:`kvbench.job.run.run_sweep`)."""

from hydra._internal.core_plugins.basic_launcher import BasicLauncher


class LocalLauncher(BasicLauncher):
    def launch(self, job_overrides, initial_job_idx):  # noqa: ANN001, ANN201 - Hydra's Launcher API
        from kvbench.job.run import run_sweep

        jobs = [r.return_value for r in super().launch(job_overrides, initial_job_idx)]
        for error in (j for j in jobs if isinstance(j, Exception)):
            raise error  # the first bad job's one line (run.py), exit 2
        raise SystemExit(run_sweep(jobs))
