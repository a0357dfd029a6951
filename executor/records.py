"""What a training step reports: its own module, so that the run (``train.py``), the idle
ranks' notes (``crew.py``) and what rank 0 shows (``progress.py``) share it without
importing one another."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    time_s: float
    lr: float = 0.0
    samples_per_s: float | None = None
    loss_scale: float | None = None  # fp16: the scale the step's backward started from
    skipped: bool = False  # fp16: an infinity or NaN in its gradients, so no update
