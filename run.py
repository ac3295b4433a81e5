#!/usr/bin/env python
"""kvbench job entry point (Hydra).

    python run.py                                   # embedded default: smollm2 × selkv × niah, budget 0.25
    python run.py method=selkv model=llama31 budget=0.25 task=longbench
    python run.py -m method=snapkv,selkv budget=0.1,0.25,0.5            # sweep (local)
    python run.py -m ... hydra/launcher=slurm                            # sweep as a SLURM array
    python run.py --help | --cfg job

Exit codes: 0 ok, 1 some samples failed (recorded in the store), 2 configuration error,
3 the job shard is locked by another process, 130 interrupted (Ctrl-C; rerun to resume),
143 terminated (SIGTERM; rerun to resume). A sweep (-m; local, parallel or slurm launcher) runs
every job and ends with one line per failed job and the largest exit code; a local sweep stops as
a whole on Ctrl-C/SIGTERM.
Guarantees and the tests that prove them: docs/RELIABILITY.md.
"""

from __future__ import annotations

import sys

from kvbench.signals import quiet_broken_pipe, stop_at_once, stop_code, stop_message  # standard library only


def run() -> int:
    """Pre-check the command line, then run the Hydra app; returns the exit code of a sweep (a
    single run exits inside). Hydra, torch and the project import here, inside the caller's
    Ctrl-C/SIGTERM guard."""
    import hydra
    from omegaconf import DictConfig

    from kvbench.cli_guard import normalize_argv, precheck_argv

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def main(cfg: DictConfig) -> int:
        """Run one job (or one job of a sweep); see kvbench.runner.hydra_main."""
        from kvbench.runner import hydra_main  # imported here: torch loads after the pre-check

        return hydra_main(cfg)

    # Bad configuration: one line `error: ...`, exit code 2, before Hydra starts (kvbench.cli_guard).
    sys.argv[1:] = normalize_argv(sys.argv[1:])
    precheck_argv(sys.argv[1:])
    main()  # a single run exits inside; a sweep returns here when its last job is done
    from kvbench.runner import finish_sweep

    return finish_sweep()  # a sweep: one line per failed job, exit code > 0 if any


if __name__ == "__main__":
    # Ctrl-C / SIGTERM outside the sample loop (start-up, imports, model load, between the jobs of
    # a local sweep): the same one line and exit code as inside it, at once (kvbench.signals).
    stop_at_once()
    try:
        code = quiet_broken_pipe(run)()  # `python run.py --help | head`: exit 141, no traceback
    except KeyboardInterrupt as stop:
        print(stop_message(stop), file=sys.stderr, flush=True)
        code = stop_code(stop)
    sys.exit(code)
