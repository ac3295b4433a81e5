"""The ``kvbench`` command: ``kvbench run ...`` (= ``python run.py ...``), ``kvbench report``,
``kvbench score``, ``kvbench mask-heads``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from .signals import quiet_broken_pipe

COMMANDS = {
    "run": "run a job or a sweep (Hydra overrides, as python run.py)",
    "report": "score tables of any sweep and the papers' tables and figures, from a results root",
    "score": "score a folder of LongBench prediction jsonl files (official result.json)",
    "mask-heads": "NIAH score drop when the top-k SRH / TRH heads are masked (CompressKV Table 2a)",
}


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    """Dispatch ``kvbench <command> ...``.

    ``kvbench run`` from the command line (``argv`` None) replaces this process by ``python
    run.py`` (same pid), so that Ctrl-C, ``kill`` and ``scancel`` reach the job itself: it stops
    cleanly, releases its lock and exits 130/143 as ``python run.py`` does. Called with ``argv``
    from Python, it runs ``run.py`` as a child process and returns its exit code.
    """
    exec_run = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        bad = not argv or argv[0] not in ("-h", "--help")  # no command is a usage error (exit 2), as in argparse
        out = sys.stderr if bad else sys.stdout
        print(f"usage: kvbench {{{','.join(COMMANDS)}}} ...\n", file=out)
        for name, text in COMMANDS.items():
            print(f"  {name:<12}{text}", file=out)
        if bad and not argv:
            print(f"error: kvbench: a command is required; accepted values are {', '.join(COMMANDS)}", file=sys.stderr)
        elif bad:
            print(f"error: kvbench {argv[0]}: unknown command; accepted values are {', '.join(COMMANDS)}", file=sys.stderr)
        return 2 if bad else 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        run_py = Path(__file__).resolve().parents[1] / "run.py"
        if exec_run:  # a child would be orphaned by a signal to this wrapper, keeping the job's lock
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, str(run_py), *rest])
        return subprocess.call([sys.executable, str(run_py), *rest])
    module = importlib.import_module(f"kvbench.{cmd.replace('-', '_')}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
