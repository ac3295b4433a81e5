"""The ``kvbench`` command (:data:`COMMANDS`; ``run`` = ``python run.py``, ``plan`` = ``python slurm/make_joblist.py
--plan``) and the one-line argument parser of every tool."""

import argparse
import importlib
import os
import sys
from pathlib import Path

#: command -> (the module whose ``main(argv)`` runs it, its one-line help)
COMMANDS = {
    "run": ("", "run a job or a sweep (Hydra overrides, as python run.py)"),
    "plan": ("", "a sweep's jobs, samples, decoded tokens (a bound) and device-hours at batch 1 and batch_size"),
    "report": ("report.build", "score tables of any sweep and the papers' tables and figures, from a results root"),
    "score": ("job.score", "score LongBench prediction files (official result.json), or a JSONL file with --task NAME"),
    "mask-heads": ("tools.mask_heads", "NIAH score drop with the top-k SRH / TRH heads masked (CompressKV Table 2a)"),
    "check-method": ("testing", "run a method (method=... overrides) on tiny random models; a table of what holds"),
    "calibrate": ("tools.calibrate", "head and layer scores for HeadKV / CompressKV (methods/artifacts/<model>)"),
}


class ArgParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, exit 2 (or ``status``)."""

    def error(self, message: str, status: int = 2):
        self.exit(status, f"{self.prog}: error: {message.splitlines()[0] if message else ''}\n")


def listof(kind: type = str, ok=lambda v: True, accepted: str = "", one: bool = False):
    """argparse type: a non-empty comma-separated list of ``kind`` values that pass ``ok`` (``one``: one, bare)."""
    def parse(text: str) -> list:
        try:
            values = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        bad = [v for v in values if not ok(v)]
        if bad or not values or (one and len(values) > 1):
            what = (accepted or f"{kind.__name__} values{', comma-separated' * (not one)}") + "; one value only" * one
            raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r}: accepted values are {what}")
        return values[0] if one else values
    return parse


def parse_with_overrides(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p.parse_args(argv)``, Hydra's ``key=value`` and ``~key`` arguments taken from anywhere (after a list flag too)
    into ``args.overrides``, first; not the value of ``--out`` or ``--*-scores``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    at = {i for i, a in enumerate(argv) if not a.startswith("-") and ("=" in a or a.startswith("~"))
          and not (i and (argv[i - 1] == "--out" or argv[i - 1].endswith("-scores")))}
    args = p.parse_args([a for i, a in enumerate(argv) if i not in at])
    args.overrides = [argv[i] for i in sorted(at)] + args.overrides
    return args


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``kvbench <command> ...`` (``run`` execs ``python run.py``: same pid for Ctrl-C and scancel)."""
    p = ArgParser(prog="kvbench", formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="\n".join(f"  {n:<14}{t}" for n, (_, t) in COMMANDS.items()))
    p.add_argument("command", choices=COMMANDS, metavar="COMMAND", help="one of those below")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's own (kvbench COMMAND -h)")
    args = p.parse_args(argv)
    if args.command in ("run", "plan"):
        script = Path(__file__).resolve().parents[1] / ("run.py" if args.command == "run" else "slurm/make_joblist.py")
        os.execv(sys.executable, [sys.executable, str(script), *["--plan"] * (args.command == "plan"), *args.args])
    return int(importlib.import_module(f"kvbench.{COMMANDS[args.command][0]}").main(args.args) or 0)


if __name__ == "__main__":
    sys.exit(main())
