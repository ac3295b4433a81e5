"""Checks of the command line that must run before Hydra composes the config.

Hydra reports an unknown config-group option (``model=llama4``) with a multi-line
traceback-like message and exit code 1; kvbench promises one line and exit code 2.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {"model": "model", "method": "method", "task": "task", "experiment": "experiment", "hydra/launcher": "hydra/launcher"}


def group_options(group: str) -> list[str]:
    """Names of the ``conf/<group>/*.yaml`` files."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _values(raw: str) -> list[str]:
    raw = raw.strip()
    m = re.fullmatch(r"choice\((.*)\)", raw)
    if m:
        raw = m.group(1)
    return [v.strip().strip("'\"") for v in raw.split(",") if v.strip()]


def precheck_argv(argv: list[str]) -> None:
    """Exit with code 2 and one line if an override names an unknown model, method, task,
    experiment or launcher (sweep lists are checked value by value)."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, raw = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in GROUPS:
            continue
        options = group_options(GROUPS[key])
        for value in _values(raw):
            if value not in options and value != "null":
                print(f"error: {key}={value}: unknown {key}; accepted values are {', '.join(options)}", file=sys.stderr)
                sys.exit(2)
