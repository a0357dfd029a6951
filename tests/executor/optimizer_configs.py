"""Every optimizer with weight decay and an LR schedule, as the optimizer tests and the
ZeRO tests (and their mpiexec driver, which must not import pytest) train them."""

from __future__ import annotations

from executor.optim import OptimizerConfig, OptimizerKind, Schedule

OPTIMIZERS = {
    "sgd": OptimizerConfig(OptimizerKind.SGD, weight_decay=0.01),
    "momentum": OptimizerConfig(OptimizerKind.MOMENTUM, momentum=0.8, weight_decay=0.01),
    "nesterov": OptimizerConfig(
        OptimizerKind.NESTEROV, momentum=0.9, schedule=Schedule.LINEAR, warmup_steps=1
    ),
    "adam": OptimizerConfig(OptimizerKind.ADAM, betas=(0.8, 0.95), weight_decay=0.01),
    "adamw": OptimizerConfig(
        OptimizerKind.ADAMW, weight_decay=0.1, schedule=Schedule.COSINE, warmup_steps=2
    ),
}
