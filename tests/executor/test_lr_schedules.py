"""Each learning-rate schedule, with and without warm-up, gives at every step the rate that
``torch.optim.lr_scheduler`` gives, composed as a torch user composes it
(tests/executor/torch_schedules.py); the decays end one step after the last (torch's
convention), so the last step still moves."""

from __future__ import annotations

import math

import pytest

from executor.optim import OptimizerConfig, Schedule
from tests.executor.torch_schedules import torch_scheduler
from tests.optional import require

torch = require("torch")

LR, STEPS = 0.3, 11


def _torch_rates(schedule: Schedule, warmup: int, total: int) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = torch.optim.SGD([param], lr=LR)
    scheduler = torch_scheduler(optimizer, schedule, warmup, total)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return rates


@pytest.mark.parametrize("warmup", [0, 1, 2, 4])
@pytest.mark.parametrize("schedule", list(Schedule))
def test_every_step_s_rate_is_torch_s(schedule: Schedule, warmup: int) -> None:
    config = OptimizerConfig(schedule=schedule, warmup_steps=warmup)
    ours = [LR * config.lr_factor(step, STEPS) for step in range(STEPS)]
    assert ours == pytest.approx(_torch_rates(schedule, warmup, STEPS), rel=1e-14, abs=1e-16)


def test_the_decays_reach_zero_one_step_after_the_last() -> None:
    """With 4 steps after the warm-up, the last one's cosine factor is
    (1 + cos(3 pi / 4)) / 2 = 0.146 and its linear one 1/4."""
    for schedule, last in ((Schedule.COSINE, (1 + math.cos(0.75 * math.pi)) / 2),
                           (Schedule.LINEAR, 0.25)):  # fmt: skip
        config = OptimizerConfig(schedule=schedule, warmup_steps=2)
        assert config.lr_factor(5, 6) == pytest.approx(last, rel=1e-15)
        assert config.lr_factor(1, 6) == 1.0 and config.lr_factor(2, 6) == 1.0
        assert _torch_rates(schedule, 2, 6)[-1] == pytest.approx(LR * last, rel=1e-15)
