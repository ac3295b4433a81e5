"""Checks of the command line that run before Hydra starts: one line on stderr, exit code 2.

Hydra reports a bad override (an unknown key such as ``budgett=0.1``, an unknown option such as
``model=llama4``, a syntax error, ``+experiment=NAME`` for a group already in the defaults list)
with a multi-line message and exit code 1, silently ignores ``experiment=typo`` (the experiment
group is optional), and creates its run folder under
``output_root`` before the job can say that the folder is not writable. :func:`precheck_argv`
therefore composes the config itself with Hydra's compose API (the same search path, config
groups and plugins as ``hydra.main``), turns every composition error into one line, and runs
:func:`kvbench.validate.validate` on the result — for a sweep (``-m``) on every value of every
swept key (command line and ``hydra.sweeper.params`` of an experiment), one key at a time.

Left to Hydra untouched: ``--help``, ``--hydra-help``, ``--version``, ``--info``,
``--shell-completion``, ``--config-path``/``--config-dir`` and ``--experimental-rerun``.
``--cfg`` gets the composition check only (no validation: it is for looking at a config).
Set ``KVBENCH_DEBUG=1`` to see a traceback for an unexpected validation failure.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn

import yaml

CONF = Path(__file__).resolve().parents[1] / "conf"
EXIT_CONFIG = 2


def fail(message: str) -> NoReturn:
    """Print ``error: <message>`` (one line) on stderr and exit with code 2."""
    line = " ".join(str(message).split())
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG)


def composition_error(overrides: list[str], config_name: str = "config") -> str | None:
    """The one-line diagnosis ``run.py`` gives when ``overrides`` cannot be composed (an unknown key
    lists the node's accepted keys, with a "did you mean"), without ``error: `` and without
    exiting; None when they compose. For the other command-line tools (``kvbench.latency``)."""
    import contextlib
    import io

    from hydra import initialize_config_dir

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), initialize_config_dir(
                config_dir=str(CONF), version_base="1.3", job_name="kvbench_compose"):
            _Composer(config_name).compose(overrides)
    except SystemExit:
        return err.getvalue().strip().removeprefix("error: ") or None
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__


def _parse_args(argv: list[str]) -> Any | None:
    """Hydra's own argument parser on ``argv`` (None when it would reject them: Hydra reports that)."""
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return get_args_parser().parse_args(argv)
    except SystemExit:
        return None


def _default_groups() -> set[str]:
    """Config groups named in ``conf/config.yaml``'s defaults list (``experiment`` included)."""
    data = yaml.safe_load((CONF / "config.yaml").read_text()) or {}
    groups: set[str] = set()
    for entry in data.get("defaults", []):
        if isinstance(entry, dict):
            for key in entry:
                groups.add(re.sub(r"^(optional|override)\s+", "", str(key)).strip().lstrip("/"))
    return groups


class _Composer:
    """Hydra's compose API plus the diagnosis of its errors (inside ``initialize_config_dir``)."""

    def __init__(self, config_name: str):
        from hydra.core.global_hydra import GlobalHydra

        self.config_name = config_name
        self.loader = GlobalHydra.instance().config_loader()
        self.groups = _default_groups() | set(self.loader.list_groups(""))
        self.groups |= {f"hydra/{g}" for g in self.loader.list_groups("hydra")}
        self.groups.discard("hydra")

    def options(self, group: str) -> list[str]:
        try:
            return sorted(self.loader.get_group_options(group))
        except Exception:  # noqa: BLE001 - an absent folder has no options
            return []

    def is_group(self, key: str) -> bool:
        return key in self.groups

    def check_group_value(self, key: str, value: Any, shown: str) -> None:
        if value is None or value == "null":
            return
        options = self.options(key)
        if key == "hydra/launcher" and str(value) == "joblib" and "joblib" not in options:
            fail("hydra/launcher=parallel: needs the joblib launcher plugin; run `pip install hydra-joblib-launcher`")
        if str(value) not in options:
            accepted = ", ".join(options) if options else f"(none: conf/{key}/ holds no .yaml file)"
            from .values import did_you_mean

            fail(f"{shown}={value}: unknown {key.split('/')[-1]}{did_you_mean(str(value), options)}; "
                 f"accepted values are {accepted}")

    def compose(self, overrides: list[str]) -> Any:
        """Compose with ``overrides`` (hydra node included) or exit with one line."""
        from hydra import compose
        from hydra.errors import ConfigCompositionException, MissingConfigException

        try:
            return compose(self.config_name, overrides=overrides, return_hydra_config=True)
        except MissingConfigException as e:
            missing = str(getattr(e, "missing_cfg_file", "") or "")
            group, _, value = missing.rpartition("/")
            if group and self.is_group(group):
                self.check_group_value(group, value, group)
            fail(_first_line(e))
        except ConfigCompositionException as e:
            self._diagnose(e, overrides)
        except Exception as e:  # noqa: BLE001 - any other Hydra/OmegaConf error: one line
            fail(f"cannot compose the config: {_first_line(e)}")

    def _diagnose(self, err: Exception, overrides: list[str]) -> NoReturn:
        """One line for a composition error: unknown keys list the node's keys, ``+`` misuse says
        how to write the override, anything else is Hydra's first line with the override."""
        from hydra import compose
        from omegaconf import OmegaConf

        from .values import unknown_key_error

        def bare(o: str) -> str:
            return re.sub(r"^[+~]+", "", o.split("=", 1)[0])

        def plus_line(key: str) -> str:
            return next((o for o in overrides if o.startswith("+") and bare(o) == key), f"+{key}")

        text = str(err)
        m = re.match(r"Could not override '([^']+)'", text)
        line = next((o for o in overrides if bare(o) == m.group(1)), None) if m else None
        if m and line is not None and not m.group(1).startswith("hydra."):
            parent, _, leaf = m.group(1).rpartition(".")
            try:
                base = compose(self.config_name, overrides=[o for o in overrides if self.is_group(bare(o))])
                node = OmegaConf.select(base, parent) if parent else base
            except Exception:  # noqa: BLE001 - fall back to Hydra's own words below
                node = None
            if OmegaConf.is_dict(node):
                accepted = [str(k) for k in node.keys() if k != "name"]
                what = f"key for {parent} {node.get('name')}" if parent in ("method", "task") else (
                    f"{parent} key" if parent else "config key")
                value = line.split("=", 1)[1] if "=" in line else ""
                fail(str(unknown_key_error(f"{parent}." if parent else "", leaf, value, accepted, what)))
        twice = re.search(r"Multiple values for ([\w/]+)", text)
        if twice:
            line = plus_line(twice.group(1))
            fail(f"{line}: {twice.group(1)} is already in the defaults list; write {line.lstrip('+')} (without the leading +)")
        taken = re.search(r"An item is already at '([^']+)'", text)
        if taken:
            line = plus_line(taken.group(1))
            fail(f"{line}: {taken.group(1)} already exists; write {line.lstrip('+')} (without the leading +)")
        culprit = line or next((o for o in overrides if "=" in o and bare(o) in text), None)
        cause = f" ({_first_line(err.__cause__)})" if err.__cause__ is not None else ""
        fail(f"{culprit + ': ' if culprit else ''}{_first_line(err)}{cause}")


def _sweep_values(override: Any) -> list[str]:
    """The values of a sweep override, or exit with one line for sweeps Hydra cannot enumerate."""
    from hydra.errors import HydraException

    try:
        return list(override.sweep_string_iterator())
    except HydraException:
        fail(
            f"{override.input_line}: interval() sweeps need a sampling sweeper plugin (Optuna, Nevergrad); "
            "use a comma list, range() or choice()"
        )


#: A sweep of at most this many jobs is pre-checked job by job; a larger one one swept key at a time.
MAX_CHECKED_JOBS = 128


def _jobs(base: list[str], sweeps: list[tuple[str, list[str]]]) -> Iterator[list[str]]:
    """Every job of the sweep (the product of the swept values, in Hydra's order) as overrides."""
    for combo in itertools.product(*[[f"{key}={v}" for v in values] for key, values in sweeps]):
        yield base + list(combo)


def _around(base: list[str], sweeps: list[tuple[str, list[str]]], center: list[str]) -> list[list[str]]:
    """``center`` (a job's overrides) and every job that differs from it in one swept value."""
    swept = center[len(base):]
    out = [center]
    for i, (key, values) in enumerate(sweeps):
        for value in values:
            if f"{key}={value}" != swept[i]:
                out.append(base + swept[:i] + [f"{key}={value}"] + swept[i + 1:])
    return out


def _job_folder(cfg: Any, overrides: list[str], config_name: str = "config") -> tuple[str, Any, Any] | None:
    """(job folder, shard index, shard count) of a valid composed job, as ``run.py`` names it
    (inside :func:`precheck`'s ``initialize_config_dir``)."""
    from hydra import compose
    from omegaconf import OmegaConf

    from .store import folder_method_overrides, job_relpath

    try:
        job, _ = _job_config(cfg)
        choice = OmegaConf.select(cfg, "hydra.runtime.choices.method", default=None)
        method_overrides = folder_method_overrides(overrides, job.get("method") or {},
                                                   lambda ov: compose(config_name, overrides=ov))
        shard = job.get("shard") or {}
        return job_relpath(job, choice, method_overrides), shard.get("index"), shard.get("count")
    except Exception:  # noqa: BLE001 - no folder name for this config: nothing to compare
        return None


def _check_folders(folders: dict[int, tuple], variants: list[list[str]], n_base: int) -> None:
    """Exit with one line when two checked jobs of a sweep would write the same job folder (and
    shard): the second would stop on the first one's lock or stored setting."""
    seen: dict[tuple, int] = {}
    for i, folder in sorted(folders.items()):
        if folder in seen:  # other values (seed=0,1) or one value twice (budget=0.1,0.1)
            a, b = (" ".join(variants[k][n_base:]) for k in (seen[folder], i))
            fail(f"sweep jobs {a} and {b} write the same job folder {folder[0]} (its name holds task, model, method "
                 "preset, budget, run_tag and the method.* overrides); list each value once, or give each job its "
                 "own run_tag, e.g. 'run_tag=seed${seed}'")
        seen.setdefault(folder, i)


def _checked_jobs(composer: "_Composer", base: list[str], sweeps: list[tuple[str, list[str]]],
                  first: Any) -> tuple[list[list[str]], dict[int, str]]:
    """The jobs to pre-check and their errors (index → one-line error).

    Every job when the sweep has at most :data:`MAX_CHECKED_JOBS`; else the first valid job of
    the sweep's order (at most that many tried), every job one swept value away from it and, for
    each of those that fails, the first valid job with its value (at most that many tried), so
    that whether a value is refused does not depend on the order in which values are listed.
    ``first``: the composed config of the sweep's first job (already composed by the caller).
    """
    folders: dict[int, tuple] = {}

    def error(overrides: list[str], cfg: Any = None, index: int | None = None) -> str | None:
        cfg = cfg if cfg is not None else composer.compose(overrides)
        message = _validation_error(*_job_config(cfg))
        folder = _job_folder(cfg, overrides, composer.config_name) if message is None and index is not None else None
        if folder is not None:
            folders[index] = folder
        return message

    jobs = _jobs(base, sweeps)
    n_jobs = math.prod(len(values) for _, values in sweeps) if sweeps else 1
    if n_jobs <= MAX_CHECKED_JOBS:
        variants = list(jobs)
        errors = {i: e for i, v in enumerate(variants) if (e := error(v, first if i == 0 else None, i)) is not None}
        _check_folders(folders, variants, len(base))
        return variants, errors
    first_error = None
    for i, job in enumerate(itertools.islice(jobs, MAX_CHECKED_JOBS)):
        e = error(job, first if i == 0 else None)
        if e is None:
            variants = _around(base, sweeps, job)
            errors = {k: e for k, v in enumerate(variants[1:], 1) if (e := error(v)) is not None}
            for k in list(errors):  # a value failing next to this job may suit other values of other keys
                i = next(j for j, (a, b) in enumerate(zip(variants[k][len(base):], job[len(base):])) if a != b)
                key, value = variants[k][len(base) + i].split("=", 1)
                pinned = sweeps[:i] + [(key, [value])] + sweeps[i + 1:]
                valid = next((v for v in itertools.islice(_jobs(base, pinned), MAX_CHECKED_JOBS) if error(v) is None),
                             None)
                if valid is not None:
                    variants.append(valid)
            return variants, errors
        first_error = first_error or e
    return [base], {0: first_error}


def _check_sweep(variants: list[list[str]], errors: dict[int, str], n_base: int,
                 nothing_done: str = "no job of the sweep was started") -> None:
    """Decide on the pre-checked jobs of a sweep (``errors``: variant index → one-line error).

    Exits (code 2, one line) when a swept value fails in every checked job that has it (an
    unknown method, ``budget=abc``: no job with it can run) or every job fails. Otherwise the
    jobs whose combination fails (a token budget below the window of one of the swept methods)
    are listed as warnings and the sweep runs: those jobs stop with the same error before their
    model loads, the others run, and the sweep ends with one line per failed job.
    """
    if not errors:
        return
    if len(errors) == len(variants):
        fail(f"{errors[0]}; {nothing_done} (none of them can run)")
    for overrides in sorted({o for v in variants for o in v[n_base:]}):
        having = [i for i, v in enumerate(variants) if overrides in v[n_base:]]
        if all(i in errors for i in having):
            fail(f"{errors[having[0]]}; {nothing_done} (no job with {overrides} can run: drop "
                 "that value)")
    for n, (i, message) in enumerate(sorted(errors.items())):
        if n == 5:
            print(f"warning: {len(errors) - 5} more sweep jobs will stop with a configuration error", file=sys.stderr)
            break
        print(f"warning: sweep job {' '.join(variants[i][n_base:])} will stop with a configuration error "
              f"(the other jobs run): {message}", file=sys.stderr)


def _experiment_choice(cfg: Any) -> str:
    """The experiment preset a composed config (hydra node included) selected, ``""`` for none."""
    from omegaconf import OmegaConf

    return str(OmegaConf.select(cfg, "hydra.runtime.choices.experiment", default=None) or "")


def _job_config(cfg: Any) -> tuple[dict, str]:
    """The job's part of a composed config (hydra node removed), resolved to plain containers,
    and the selected experiment preset (``""`` for none)."""
    from omegaconf import OmegaConf, open_dict

    experiment = _experiment_choice(cfg)
    with open_dict(cfg):
        cfg = cfg.copy()
        cfg.pop("hydra", None)
    try:
        return OmegaConf.to_container(cfg, resolve=True), experiment
    except Exception as e:  # noqa: BLE001 - interpolation errors
        key = getattr(e, "full_key", None)
        fail(f"{key + ': ' if key else ''}cannot resolve the config ({_first_line(e)})")


def _validation_error(job: dict, experiment: str) -> str | None:
    """The one-line error of a job config (``kvbench.validate.validate``), None when it is valid."""
    from eval.base import TaskConfigError
    from methods.base import ConfigError

    from .validate import validate

    try:
        validate(job, layout=False, experiment=experiment)  # the job checks the layout before loading the weights
    except (ConfigError, TaskConfigError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a bug or an input no check foresaw: still one line
        if os.environ.get("KVBENCH_DEBUG") == "1":
            raise
        return f"invalid configuration ({type(e).__name__}: {_first_line(e)}); set KVBENCH_DEBUG=1 for a traceback"
    return None


def _check_slurm_reachable(timeout_s: float = 60) -> None:
    """Before a SLURM sweep submits anything: exit with one line when ``sbatch`` is not on PATH or
    the controller does not answer ``sinfo`` (submitit would end the sweep in a traceback)."""
    import shutil
    import subprocess

    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        fail("hydra/launcher=slurm: sbatch/sinfo not found on PATH; submit from a SLURM login node, or drop "
             "hydra/launcher=slurm to run the sweep here")
    try:
        proc = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        fail(f"hydra/launcher=slurm: the SLURM controller did not answer sinfo ({_first_line(e)}); check it with "
             "`scontrol ping`")
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        said = lines[0].strip() if lines else f"exit {proc.returncode}"
        fail(f"hydra/launcher=slurm: cannot reach the SLURM controller (sinfo: {said}); check it with `scontrol ping`")


def _options_first(argv: list[str]) -> list[str]:
    """Hydra's options (``-m``, ``--cfg job``, ``-p PKG``...) moved before the overrides, each with
    its value, the rest in its order: argparse rejects ``run.py budget=0.5 -m`` ("unrecognized
    arguments") although an option after the overrides is a common way to write a command.
    Tokens that are no Hydra option stay where they are (argparse names them)."""
    from hydra._internal.utils import get_args_parser

    actions = {s: a for a in get_args_parser()._actions for s in a.option_strings}
    options, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        action = actions.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if action is None:
            rest.append(token)
            i += 1
            continue
        take = 1
        if "=" not in token and i + 1 < len(argv):
            if action.nargs is None:  # one value: the next token
                take = 2
            elif action.nargs == "?" and action.choices is not None and argv[i + 1] in action.choices:
                take = 2
        options += argv[i : i + take]
        i += take
    return options + rest


def normalize_argv(argv: list[str]) -> list[str]:
    """Hydra's options first (:func:`_options_first`), and ``experiment=NAME`` accepted as well as
    Hydra's ``+experiment=NAME`` (the experiment group is not in the defaults list, so Hydra itself
    only takes the ``+`` form)."""
    return ["+" + a if a.startswith("experiment=") else a for a in _options_first(argv)]


def precheck_argv(argv: list[str], nothing_done: str = "no job of the sweep was started") -> None:
    """Exit with code 2 and one line if the command line cannot make a valid job (or sweep).

    Returns normally when the configuration is valid, or for the options left to Hydra.
    ``nothing_done`` ends the line of a sweep none of whose jobs (or none with one value) can
    run: what the caller did not do (``slurm/make_joblist.py``: no job list was written).
    """
    args = _parse_args(argv)
    if args is None:
        return
    modes = [getattr(args, n, None) not in (None, False) for n in ("run", "multirun", "cfg", "info", "shell_completion")]
    if sum(modes) > 1:
        fail("only one of --run, --multirun (-m), --cfg, --info and --shell-completion can be given")
    left_to_hydra = ("help", "hydra_help", "shell_completion", "config_path", "config_dir", "experimental_rerun")
    if any(getattr(args, name, None) for name in left_to_hydra) or getattr(args, "info", None) is not None:
        return
    from hydra import initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob
    from hydra.errors import OverrideParseException
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="kvbench_precheck"):
        composer = _Composer(args.config_name or "config")
        parser = OverridesParser.create()
        parsed = []
        for text in args.overrides:
            try:
                parsed.extend(parser.parse_overrides([text]))
            except OverrideParseException as e:
                hint = ("; a path starting with ~ needs quotes (key='~/x') or $HOME"
                        if "=~" in text or "=[~" in text else "; write key=value, see python run.py --help")
                fail(f"{text}: cannot parse this override ({_first_line(e)}){hint}")
        seen: dict[str, str] = {}
        for o in parsed:  # Hydra keeps the last of two values silently (a script's defaults, then a change)
            key = o.key_or_group.lstrip("+~")
            if key in seen and seen[key] != o.input_line:
                print(f"warning: {key} is given twice ({seen[key]}, {o.input_line}); the last one is used",
                      file=sys.stderr)
            seen[key] = o.input_line
        base, sweeps = [], []
        for o in parsed:
            key = o.key_or_group
            if isinstance(o.value(), Glob) and composer.is_group(key):  # glob(snap*) over a group's options
                values = o.value().filter(composer.options(key))
                if not values:
                    fail(f"{o.input_line}: matches no {key} option; accepted values are "
                         f"{', '.join(composer.options(key))}")
            else:
                values = _sweep_values(o) if o.is_sweep_override() else [o.value()]
            if o.is_sweep_override() and not args.multirun:
                fail(f"{o.input_line}: several values need --multirun (-m) to sweep; for a list value write {key}=[...]")
            if composer.is_group(key) and not o.is_delete():
                for v in values:
                    composer.check_group_value(key, v, o.get_key_element())
            if o.is_sweep_override():
                sweeps.append((o.get_key_element(), values))
            else:
                base.append(o.input_line)
        cfg = composer.compose(next(_jobs(base, sweeps)))
        params = cfg.hydra.sweeper.get("params") if "sweeper" in cfg.hydra else None
        if params and not args.multirun and args.cfg is None:
            # A preset's sweep (hydra.sweeper.params) only runs with -m; without it Hydra would run
            # one job at the defaults, which may not be in the preset's grid at all.
            given = {o.key_or_group.lstrip("+~") for o in parsed}
            unset = [k for k in params if k not in given]
            if unset:
                experiment = _experiment_choice(cfg) or "the config"
                fail(f"experiment={experiment} sweeps {', '.join(unset)} (hydra.sweeper.params): add --multirun (-m) "
                     f"to run its jobs, or set {'it' if len(unset) == 1 else 'each'} on the command line for one job")
        launcher = str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
        if not args.multirun and args.cfg is None and launcher and not launcher.endswith("BasicLauncher"):
            # Hydra uses a launcher for a sweep only: without -m the job would run here, in this process
            choice = OmegaConf.select(cfg, "hydra.runtime.choices.hydra/launcher", default=None) or launcher
            fail(f"hydra/launcher={choice}: a launcher runs the jobs of a sweep only; add --multirun (-m) "
                 "(without it this command would run the one job here, on this machine)")
        if args.multirun and launcher.endswith("SlurmLauncher"):
            _check_slurm_reachable()
        if args.multirun and launcher.endswith("JoblibLauncher"):
            n_par = OmegaConf.select(cfg, "hydra.launcher.n_jobs", default=None)
            cores = os.cpu_count() or 1
            if isinstance(n_par, int) and (n_par == 0 or n_par < -cores):
                fail(f"hydra.launcher.n_jobs={n_par}: must be the number of jobs run at once (>= 1) or between "
                     f"-{cores} and -1 (joblib's -k: CPU cores + 1 - k; -1 runs one job per core)")
        if args.multirun:
            swept = {k.lstrip("+~") for k, _ in sweeps}
            extra = []
            for key, text in (params or {}).items():
                if key in swept:
                    continue  # the command line wins, as in Hydra
                try:
                    (o,) = parser.parse_overrides([f"{key}={text}"])
                except OverrideParseException as e:
                    fail(f"hydra.sweeper.params.{key}={text}: cannot parse ({_first_line(e)})")
                extra.append((o.get_key_element(), _sweep_values(o) if o.is_sweep_override() else [str(text)]))
            if extra:
                cfg = composer.compose(next(_jobs(base, sweeps + extra)))
        if args.cfg is not None:
            return
        variants, errors = _checked_jobs(composer, base, sweeps + extra if args.multirun else sweeps, cfg)
        if args.multirun:
            _check_sweep(variants, errors, len(base), nothing_done)
        elif errors:
            fail(errors[0])
