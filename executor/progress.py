"""What rank 0 shows while training: a progress bar, step lines, JSON, a metrics file.

- ``--json``: one JSON object per step and per evaluation on stdout, nothing else;
- a terminal: one progress line (tqdm) with the step, loss, samples/s and time left,
  evaluations printed above it;
- anything else (a log file, a pipe): one line per step with the same figures;
- ``--metrics run.jsonl``: one JSON object per step and per evaluation, flushed as they
  come (appended to when the run resumes), whatever is shown, and the run's summary last
  (steps, final loss, bytes sent and peak memory per rank); ``onnx2soap plot`` draws it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from executor.evaluation import EvalRecord
from executor.records import StepRecord


def step_fields(record: StepRecord) -> dict[str, Any]:
    fields = {
        "step": record.step,
        "loss": record.loss,
        "lr": record.lr,
        "time_s": record.time_s,
        "samples_per_s": record.samples_per_s,
    }
    if record.loss_scale is not None:  # fp16: the scale, and whether the update was skipped
        fields["loss_scale"] = record.loss_scale
        fields["skipped"] = record.skipped
    return fields


def eval_fields(record: EvalRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {"step": record.step, "eval_loss": record.loss}
    if record.accuracy is not None:
        fields["eval_accuracy"] = record.accuracy
    return fields


def _eval_line(record: EvalRecord) -> str:
    accuracy = "" if record.accuracy is None else f"  accuracy {record.accuracy:.4f}"
    return f"eval after step {record.step}: loss {record.loss:.6f}{accuracy}"


@dataclass
class Progress:
    """Rank 0's view of the run; call ``step`` and ``evaluation`` as records come."""

    total_steps: int
    as_json: bool
    metrics: Path | None = None
    resumed: bool = False  # append to the metrics file
    out: TextIO = field(default_factory=lambda: sys.stdout)
    _bar: Any = None
    _file: TextIO | None = None
    _times: list[float] = field(default_factory=list)

    def _start_bar(self, step: int) -> None:
        """A terminal gets a progress line, from the first step this run takes."""
        if self._times or self.as_json or not self.out.isatty():
            return
        from tqdm import tqdm

        self._bar = tqdm(total=self.total_steps, initial=step - 1, unit="step", file=self.out)

    def step(self, record: StepRecord) -> None:
        self._start_bar(record.step)
        fields = step_fields(record)
        self._times.append(record.time_s)
        self._record(fields)
        if self.as_json:
            self._print(json.dumps(fields))
        elif self._bar is not None:
            rate = fields["samples_per_s"] or 0.0
            self._bar.set_postfix(loss=f"{record.loss:.4f}", samples_s=f"{rate:.0f}")
            self._bar.update(1)
        else:
            self._print(self._line(record, fields))

    def _line(self, record: StepRecord, fields: dict) -> str:
        recent = self._times[-20:]
        left = (self.total_steps - record.step) * sum(recent) / len(recent)
        rate = fields["samples_per_s"] or 0.0
        return (
            f"step {record.step:4d}  loss {record.loss:.6f}  time {record.time_s * 1e3:8.2f} ms"
            f"  {rate:9.1f} samples/s  left {left:7.1f} s"
        )

    def evaluation(self, record: EvalRecord) -> None:
        fields = eval_fields(record)
        self._record(fields)
        if self.as_json:
            self._print(json.dumps(fields))
        elif self._bar is not None:
            self._bar.write(_eval_line(record), file=self.out)
        else:
            self._print(_eval_line(record))

    def _record(self, fields: dict) -> None:
        if self.metrics is None:
            return
        if self._file is None:  # opened with the first record: after the run's checks
            self._file = open(self.metrics, "a" if self.resumed else "w")  # noqa: SIM115
        self._file.write(json.dumps(fields) + "\n")
        self._file.flush()

    def summary(self, fields: dict) -> None:
        """The run's summary, last in the metrics file (readers skip it)."""
        self._record({"summary": fields})

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
