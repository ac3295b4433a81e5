#!/usr/bin/env python
"""kvbench job entry point (Hydra).

    python run.py                                   # embedded default: smollm2 × selkv × niah, budget 0.25
    python run.py method=selkv model=llama31 budget=0.25 task=longbench
    python run.py -m method=snapkv,selkv budget=0.1,0.25,0.5            # sweep (local)
    python run.py -m ... hydra/launcher=slurm                            # sweep as a SLURM array
    python run.py --help | --cfg job

Exit codes: 0 ok, 1 some samples failed (stored with their error; rerun to retry them) or an
I/O error, 2 configuration error (one line ``error: <key>...``, before any model loads), 3 the job
shard is locked by another process. A local sweep runs every job and exits with the largest code.
"""

from __future__ import annotations

import os
import sys

CONFIG_ERRORS = ("ConfigError", "TaskConfigError", "HydraException", "OmegaConfBaseException", "OverrideParseException")


def main() -> int:
    """Run the Hydra app; turn a configuration error into one line and exit code 2."""
    import hydra

    os.environ["HYDRA_FULL_ERROR"] = "1"  # errors reach the handler below instead of Hydra's report
    args = [f"+{a}" if a.startswith("experiment=") else a for a in sys.argv[1:]]  # experiment=NAME means +experiment=NAME
    modes = {"-m", "--multirun", "-c", "--cfg", "--info", "-h", "--help", "--hydra-help", "-sc", "--shell-completion"}
    if any(a.startswith("hydra/launcher=") for a in args) and not modes & set(args):
        args.append("--multirun")  # a launcher runs sweeps: without -m it would run the job here
    sys.argv[1:] = args

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def app(cfg) -> int:
        from kvbench.job import main as run_job

        return run_job(cfg)

    try:
        app()
    except Exception as e:  # noqa: BLE001 - one line for the user, exit code by kind
        kinds = {c.__name__ for c in type(e).__mro__}
        if not kinds & {*CONFIG_ERRORS, "OSError"}:
            raise
        cause, line = e.__cause__, " ".join(str(e).split()).replace(" To append to your config use +", " Add a key with +")
        if "not in struct" in str(cause) and getattr(cause, "parent_node", None) is not None:
            line += f"; accepted keys are {', '.join(sorted(cause.parent_node))}"
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 2 if kinds & set(CONFIG_ERRORS) else 1
    from kvbench.job import SWEEP_CODES

    return max(SWEEP_CODES, default=0)


if __name__ == "__main__":
    sys.exit(main())
