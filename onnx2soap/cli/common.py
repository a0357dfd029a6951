"""Options and helpers shared by several ``onnx2soap`` commands (the parsing both command
lines share is ``onnx2soap/options.py``)."""

from __future__ import annotations

import argparse

from onnx2soap.ir import LossKind
from onnx2soap.options import int_in
from onnx2soap.soap.plan import MAX_BATCH


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
