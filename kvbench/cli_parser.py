"""``argparse`` with one-line errors for the project's command-line tools.

A usage error (an unknown flag, a bad value, an ``error()`` raised by the tool's own checks)
is printed as ``<prog>: error: <message>`` alone, exit code 2, instead of argparse's usage
block followed by the message: every configuration error of kvbench is one line (see
``docs/RELIABILITY.md``). ``--help`` still prints the full usage.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose :meth:`error` prints one line (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>`` (first line of the message) to stderr and exit 2."""
        first = message.splitlines()[0] if message else ""
        self.exit(2, f"{self.prog}: error: {first}\n")
