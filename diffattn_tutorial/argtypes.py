"""Argument types the command lines share (a leaf module: ``cli`` and ``training.loop`` both use it)."""

from __future__ import annotations

import argparse
from typing import Callable


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


__all__ = ["int_at_least"]
