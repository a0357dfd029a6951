"""A run's metrics file (``executor run --metrics run.jsonl``): one JSON object a line.

    {"step": 1, "loss": 2.30, "lr": 0.01, "time_s": 0.03, "samples_per_s": 1000.0}
    {"step": 10, "eval_loss": 2.1, "eval_accuracy": 0.31}      accuracy may be absent
    {"summary": {...}}                                          ignored

Unknown keys, and objects with neither ``loss`` nor ``eval_loss``, are ignored, so the
format can grow. A line that is not a JSON object, or a loss without a proper step, is
refused with the file and line number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from onnx2soap.errors import UserError
from onnx2soap.files import check_input

MAX_LINE_BYTES = 1 << 20  # a metrics line is ~100 bytes; a huge one is not a metrics file


@dataclass(frozen=True)
class TrainPoint:
    step: int
    loss: float  # NaN where the run wrote a non-finite loss


@dataclass(frozen=True)
class EvalPoint:
    step: int
    loss: float
    accuracy: float | None


@dataclass(frozen=True)
class Metrics:
    train: tuple[TrainPoint, ...]
    eval: tuple[EvalPoint, ...]

    @property
    def nonfinite(self) -> int:
        """Losses the run wrote as NaN or infinite (the curves have gaps there)."""
        return sum(math.isnan(p.loss) for p in (*self.train, *self.eval))


def read_metrics(path: Path | str) -> Metrics:
    path = check_input(path, "metrics file")
    train: list[TrainPoint] = []
    evals: list[EvalPoint] = []
    try:
        with path.open("rb") as f:
            for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                obj = _parse_line(path, lineno, raw)
                if obj is not None:
                    _collect(path, lineno, obj, train, evals)
    except OSError as e:
        raise UserError(f"{path}: cannot read the metrics file ({e.strerror or e})") from e
    if not train and not evals:
        raise UserError(
            f"{path}: no training or evaluation lines (objects with 'step' and 'loss' "
            "or 'eval_loss')"
        )
    return Metrics(tuple(train), tuple(evals))


def _parse_line(path: Path, lineno: int, raw: bytes) -> dict | None:
    """The line's object, or None for a blank line or a summary."""
    where = f"{path}: line {lineno}"
    if len(raw) > MAX_LINE_BYTES:
        raise UserError(f"{where}: longer than {MAX_LINE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 text") from e
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno})") from e
    except RecursionError as e:
        raise UserError(f"{where}: JSON nested too deep") from e
    if not isinstance(obj, dict):
        raise UserError(f"{where}: not a JSON object")
    return None if "summary" in obj else obj


def _collect(
    path: Path, lineno: int, obj: dict, train: list[TrainPoint], evals: list[EvalPoint]
) -> None:
    where = f"{path}: line {lineno}"
    if "loss" in obj:
        train.append(TrainPoint(_step(where, obj), _number(where, obj, "loss")))
    if "eval_loss" in obj:
        accuracy = obj.get("eval_accuracy")
        evals.append(
            EvalPoint(
                _step(where, obj),
                _number(where, obj, "eval_loss"),
                None if accuracy is None else _number(where, obj, "eval_accuracy"),
            )
        )


def _step(where: str, obj: dict) -> int:
    step = obj.get("step")
    # bool is an int in Python; "step": true is a broken writer, not step 1.
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UserError(f"{where}: 'step' must be a non-negative integer, got {step!r:.40}")
    return step


def _number(where: str, obj: dict, key: str) -> float:
    value = obj[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{where}: '{key}' must be a number, got {value!r:.40}")
    value = float(value)
    return value if math.isfinite(value) else math.nan
