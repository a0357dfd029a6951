"""Options and helpers shared by several commands.

Every option value is checked where it enters, against a stated range: a bad value is a
one-line usage error (exit 2), never a traceback deep inside, a hang or a huge allocation.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from onnx2soap.errors import UserError
from onnx2soap.ir import LossKind
from onnx2soap.soap.plan import MAX_BATCH

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


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument(
        "--batch",
        type=int_in(1, MAX_BATCH),
        help=f"batch size (binds a symbolic batch dim; 1 to {MAX_BATCH})",
    )
    p.add_argument(
        "--loss",
        choices=[k.value for k in (LossKind.CROSS_ENTROPY, LossKind.MSE, LossKind.NONE)],
        help="loss to attach when the model has none (default: cross-entropy)",
    )


def add_nonfinite_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="train with NaN/Inf in the weights it loads (refused by default)",
    )


def loss_choice(value: str | None) -> LossKind | None:
    return LossKind(value) if value else None


def human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"


def seconds(t: float) -> str:
    if t != t or t == float("inf"):
        return "inf"
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.2f} MiB"
