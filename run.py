#!/usr/bin/env python
"""kvbench's entry point (Hydra): ``python run.py [overrides]`` one job, ``-m`` a sweep (README.md). Beside Hydra:
options go before overrides, ``experiment=X`` is ``+experiment=X``, a launcher adds ``--multirun``, and a
configuration error becomes one line naming the key, exit 2."""

import os
import signal
import sys
from pathlib import Path

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import open_dict

CONFIG_ERRORS = ("ConfigError", "TaskConfigError", "HydraException", "OmegaConfBaseException", "OverrideParseException")
CONF = Path(__file__).resolve().parent / "conf"


def _arguments(argv: list[str]) -> list[str]:
    """The arguments as Hydra takes them (the module docstring says which changes and why). HydraException: an
    option Hydra does not have (``--budget 0.25``)."""
    parsed, unknown = get_args_parser().parse_known_intermixed_args(argv)
    if unknown:
        name, eq, value = unknown[0].partition("=")
        i = argv.index(unknown[0])
        given = argv[i : i + 1 + (not eq and i + 1 < len(argv) and "=" not in argv[i + 1] and argv[i + 1][:1] != "-")]
        raise HydraException(f"{' '.join(given)}: no such option; a config key is set by an override, key=value"
                             f" without dashes: {name.lstrip('-')}={(given[1:] or [value])[0] or '...'} (python "
                             "run.py --help)")
    options = [a for a in argv if a not in parsed.overrides]
    overrides = [f"+{a}" if a.startswith("experiment=") else a for a in parsed.overrides]
    if any(a.startswith("hydra/launcher=") for a in overrides) and not options:
        options = ["--multirun"]
    return options + overrides


def main() -> int:
    """Run one job (composed once) or the Hydra app; a configuration error: one line, exit 2."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # errors reach the handler below instead of Hydra's report
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # timeout, kill: as Ctrl-C (locks freed, exit 130)
    args = sys.argv[1:]
    try:
        args = _arguments(args)
        from kvbench.job.config import compose
        from kvbench.job.run import main as run_job

        if not any(a.startswith("-") for a in args):  # one job: compose once (hydra.main also composes for the mode)
            cfg = compose(args, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            with open_dict(cfg):
                del cfg["hydra"]
            return run_job(cfg)
        sys.argv[1:] = args
        hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")(run_job)()  # a sweep: exits
    except KeyboardInterrupt:
        print("interrupted: the samples stored so far are kept; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for the user, exit code by kind
        kinds = {c.__name__ for c in type(e).__mro__}
        config = kinds & set(CONFIG_ERRORS) or str(e).startswith(("Config group override", "Only one of --run"))
        if not (config or kinds & {"OSError", "FailedJobError"}):  # FailedJobError: sbatch failed
            raise
        if not ("FailedJobError" in kinds and getattr(e.__cause__, "stderr", None)):  # else submitit printed sbatch's
            from kvbench.job.config import one_line

            print(f"error: {one_line(e, args)}", file=sys.stderr, flush=True)
        return 2 if config else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
