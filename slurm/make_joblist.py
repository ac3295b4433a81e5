#!/usr/bin/env python
"""Expand a Hydra sweep into a job list for ``slurm/array.sbatch``: one line of overrides per job.

Array task *i* runs ``python run.py <line i>``. Jobs come in the order of Hydra's basic sweeper
(the cartesian product of the comma lists, the last key varying fastest)::

    python slurm/make_joblist.py method=snapkv,selkv budget=0.1,0.25 task=niah -o jobs.txt

``--shards N`` splits every job into N array tasks (``shard.index=k shard.count=N``) writing
into one job folder. Overrides are shell-quoted, so a line can be pasted after ``python run.py``.
An experiment preset (``+experiment=NAME``) adds its own sweep (``hydra.sweeper.params``; keys
on the command line win). Comma lists, ``range()`` and ``choice()`` expand; ``glob()`` and
``interval()`` are refused. The overrides are not validated here: each job checks its own config.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override
from hydra.errors import HydraException


class SweepSpecError(ValueError):
    """A sweep override that cannot be expanded into a job list (one line, names the override)."""


def _choices(override: Override) -> list[str]:
    """The override strings one key contributes (``['budget=0.1', 'budget=0.25']``); SweepSpecError
    for ``glob()`` or ``interval()``."""
    if not override.is_sweep_override():
        return [override.input_line]
    if not override.is_discrete_sweep() or isinstance(override.value(), Glob):
        raise SweepSpecError(f"{override.input_line!r}: only comma lists, range() and choice() can be expanded")
    key = override.get_key_element()
    return [f"{key}={value}" for value in override.sweep_string_iterator()]


def expand(overrides: list[str], shards: int = 1) -> list[list[str]]:
    """``n_jobs * shards`` override lists (the shards of a job side by side, with ``shard.index`` and
    ``shard.count``) from the overrides of ``run.py -m``, in Hydra's multirun order.

    Raises:
        SweepSpecError: an override that does not parse or cannot be expanded, or shards < 1.
    """
    if shards < 1:
        raise SweepSpecError(f"--shards={shards}: must be an integer >= 1")
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        raise SweepSpecError(str(error).splitlines()[0]) from None
    jobs = [list(combo) for combo in itertools.product(*(_choices(o) for o in parsed))]
    if shards == 1:
        return jobs
    return [job + [f"shard.index={k}", f"shard.count={shards}"] for job in jobs for k in range(shards)]


def preset_sweeps(overrides: list[str]) -> list[str]:
    """The ``hydra.sweeper.params`` of the preset named by ``+experiment=NAME`` in ``overrides``, as
    overrides, without the keys given on the command line. SweepSpecError: no such preset."""
    import yaml

    names = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")]
    if not names:
        return []
    path = Path(__file__).resolve().parents[1] / "conf" / "experiment" / f"{names[-1]}.yaml"
    if not path.is_file():
        raise SweepSpecError(f"experiment={names[-1]}: no such preset ({path})")
    params = (((yaml.safe_load(path.read_text()) or {}).get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    return [f"{key}={value}" for key, value in params.items() if key not in given]


def format_line(job: list[str]) -> str:
    """One job-list line: the overrides, each shell-quoted, separated by single spaces."""
    return " ".join(shlex.quote(override) for override in job)


def main(argv: list[str] | None = None) -> int:
    """Command line: write the job list (``-o`` or standard output) and print the sbatch command.
    Returns 0, or 2 on a bad sweep or an unwritable ``-o`` (one line on stderr)."""
    parser = argparse.ArgumentParser(
        description="Expand Hydra sweep overrides into a job list for slurm/array.sbatch.",
        epilog="example: python slurm/make_joblist.py method=snapkv,selkv budget=0.1,0.25 -o jobs.txt",
    )
    parser.add_argument("overrides", nargs="+", help="Hydra overrides, sweeps as comma lists")
    parser.add_argument("-o", "--output", type=Path, help="job list file (default: standard output)")
    parser.add_argument("--shards", type=int, default=1, help="split every job into this many shards")
    parser.add_argument("--parallel", type=int, default=16, help="array tasks at once, for the printed command")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options, as with run.py
    if args.parallel < 1:
        parser.error(f"--parallel {args.parallel}: must be an integer >= 1 (array tasks run at once)")
    given = [o for o in args.overrides if o.lstrip("+~").startswith("shard.")]
    if given and args.shards > 1:
        parser.error(f"{given[0]}: --shards {args.shards} sets shard.index and shard.count on every line")
    try:
        overrides = [("+" + o if o.startswith("experiment=") else o) for o in args.overrides]
        jobs = expand(overrides + preset_sweeps(overrides), args.shards)
        text = "".join(format_line(job) + "\n" for job in jobs)
        if args.output is None:
            sys.stdout.write(text)
            return 0
        args.output.write_text(text, encoding="utf-8")
    except (SweepSpecError, OSError) as error:
        print(f"make_joblist: {error}", file=sys.stderr)
        return 2
    print(f"{len(jobs)} jobs written to {args.output}; submit with:\n"
          f"  sbatch --array=1-{len(jobs)}%{args.parallel} slurm/array.sbatch {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
