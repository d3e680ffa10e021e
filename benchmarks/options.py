"""argparse ``type`` callables shared by the benchmarks: bounded integers and finite numbers.

A bad value becomes argparse's one-line ``argument --NAME: ...`` error naming the value, exit 2,
before a benchmark does any work.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_option(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting an integer in ``[low, high]``.

    Raises (from the returned parser):
        argparse.ArgumentTypeError: not an integer or out of range.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def number_option(low: float, high: float, unit: str) -> Callable[[str], float]:
    """An argparse ``type`` accepting a finite number in ``[low, high]`` (``unit`` names it in messages).

    Raises (from the returned parser):
        argparse.ArgumentTypeError: not a number, NaN, infinite or out of range.
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of {unit}, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a finite number between {low:g} and {high:g} {unit}, "
                                             f"got {text!r}")
        return value

    return parse
