"""Options and helpers shared by several commands."""

from __future__ import annotations

import argparse

from onnx2soap.ir import LossKind


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--batch", type=int, help="batch size (binds a symbolic batch dim)")
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
