"""What the command lines share (a leaf module: ``cli`` and ``training.loop`` both use it): argument types, and
one way to report a bad command line: the parser raises :class:`UsageError`, ``main`` prints it with
:func:`print_usage_error` as one line on stderr and returns exit code 2 (no traceback, no ``SystemExit``)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Optional


class UsageError(ValueError):
    """A bad command line: the message names the option and the fix; ``prog`` is the (sub)command it belongs to."""

    def __init__(self, message: str, prog: Optional[str] = None):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors raise :class:`UsageError` (naming its ``prog``) instead of printing
    and exiting; subcommand parsers made with ``add_subparsers`` are of the same class."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UsageError(message, self.prog)


def print_usage_error(error: UsageError, prog: str) -> int:
    """Print ``error`` as one line on stderr, ``PROG: error: MESSAGE (see PROG --help)``; return the exit code 2."""
    prog = error.prog or prog
    print(f"{prog}: error: {' '.join(str(error).split())} (see {prog} --help)", file=sys.stderr, flush=True)
    return 2


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number ``>= minimum``; the error names the value and the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    parse.__name__ = "whole number"  # what argparse calls the type in its own messages
    return parse


__all__ = ["UsageError", "Parser", "print_usage_error", "int_at_least"]
