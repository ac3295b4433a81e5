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

    def list_arg(self, flag: str, values: list[str] | None) -> list[str] | None:
        """:func:`split_list` of a list flag; None when the flag was not given.

        Raises:
            SystemExit: the flag was given but names nothing (``--only ''``, an empty shell
                variable), which must not mean "the default" (one line, exit 2).
        """
        if values is None:
            return None
        items = split_list(values)
        if not items:
            self.error(f"{flag} {' '.join(values)!r}: empty; name at least one value (or leave the flag out)")
        return items


def split_list(values: list[str] | None) -> list[str]:
    """The items of a list flag given space- or comma-separated, or repeated
    (``--k 1 2``, ``--k 1,2``, ``--k 1 --k 2``, ``--k "1, 2"``): ``["1", "2"]``; empty pieces dropped."""
    return [x for item in values or [] for x in item.replace(",", " ").split()]
