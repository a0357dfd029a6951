"""Command-line parsing both programs share: ``onnx2soap`` and ``python -m executor``.

Every option value is checked where it enters, against a stated range: a bad value is a
one-line usage error (exit 2), never a traceback deep inside, a hang or a huge allocation.
The executor's CLI imports this, not ``onnx2soap.cli``: neither product's command line
depends on the other's.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from onnx2soap.errors import UserError

_INTEGER = re.compile(r"[+-]?[0-9]{1,30}")  # ASCII only: int() also takes "٣" and "1_0"
_MAX_NUMBER_CHARS = 64


class UsageError(UserError):
    """A bad command line: printed as one line like every user error (exit 2)."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """argparse ``type=``: an integer written in ASCII digits, within [low, high]."""

    def parse(text: str) -> int:
        if not _INTEGER.fullmatch(text.strip()) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{low}, {high}], got {_shown(text)}"
            )
        return int(text)

    return parse


def float_in(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """argparse ``type=``: a finite number within [low, high] (or (low, high])."""

    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= _MAX_NUMBER_CHARS else math.nan
        except ValueError:
            value = math.nan
        above = value > low if low_open else value >= low
        if not math.isfinite(value) or not above or value > high:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {bracket}{low:g}, {high:g}], got {_shown(text)}"
            )
        return value

    return parse


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "…")
