"""Optimizers and learning-rate schedules, written to equal ``torch.optim``'s updates.

Every rank updates its weight shards itself after the gradients of each replica group are
summed, so every replica applies the same update to the same values and stays
identical. An optimizer's state (momentum, Adam's moments) is one array per shard, shaped
like it: sharded exactly like its weight.

- ``sgd``: p -= lr (g + wd p)
- ``momentum`` / ``nesterov``: torch's SGD with momentum μ (dampening 0): b = g + wd p on
  the first step, then b = μ b + (g + wd p); the step is b, or (g + wd p) + μ b (Nesterov)
- ``adam``: torch's Adam (L2 weight decay added to the gradient), bias-corrected moments
- ``adamw``: torch's AdamW (decoupled decay: p *= 1 - lr wd before the Adam step)

Schedules multiply the base rate: linear warm-up over ``warmup_steps`` (step k of K uses
(k + 1) / K), then, over the n = steps - K steps after it, ``constant``, ``cosine`` (step
K + j uses (1 + cos(pi j / n)) / 2) or ``linear`` (1 - j / n). That is torch's convention:
``SequentialLR`` of ``LinearLR(start_factor=1/K, total_iters=K-1)`` and
``CosineAnnealingLR(T_max=n)`` or ``LinearLR(1, 0, total_iters=n)``, milestone K (one
scheduler step after each optimizer step). Both decays reach 0 one step after the last,
so the last step still moves: cosine's last factor is (1 + cos(pi (n-1) / n)) / 2, 0.146
for n = 4; linear's is 1 / n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from onnx2soap.errors import UserError


class OptimizerKind(Enum):
    SGD = "sgd"
    MOMENTUM = "momentum"
    NESTEROV = "nesterov"
    ADAM = "adam"
    ADAMW = "adamw"


class Schedule(Enum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


SLOTS = {
    OptimizerKind.SGD: (),
    OptimizerKind.MOMENTUM: ("momentum",),
    OptimizerKind.NESTEROV: ("momentum",),
    OptimizerKind.ADAM: ("exp_avg", "exp_avg_sq"),
    OptimizerKind.ADAMW: ("exp_avg", "exp_avg_sq"),
}


@dataclass(frozen=True)
class OptimizerConfig:
    """The update rule and schedule; the base learning rate is the run's ``--lr``."""

    kind: OptimizerKind = OptimizerKind.SGD
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Schedule = Schedule.CONSTANT
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise UserError(f"--betas {self.betas[0]} {self.betas[1]}: each must be in [0, 1)")
        if not 0.0 <= self.momentum < 1.0:
            raise UserError(f"--momentum {self.momentum}: must be in [0, 1)")

    @property
    def slots(self) -> tuple[str, ...]:
        """The state arrays each weight shard carries."""
        return SLOTS[self.kind]

    def lr_factor(self, step: int, total: int) -> float:
        """The schedule's factor at 0-based ``step`` of ``total`` steps (see the module's
        docstring: torch's schedulers give the same)."""
        k = self.warmup_steps
        if step < k:
            return (step + 1) / k
        if self.schedule is Schedule.CONSTANT or total <= k:
            return 1.0
        progress = (step - k) / max(total - k, 1)
        if self.schedule is Schedule.COSINE:
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress


def apply_update(xp, config: OptimizerConfig, param, grad, state: dict, lr: float, t: int):
    """Update ``param`` in place from its summed gradient ``grad`` (which it may
    overwrite); ``state`` holds the shard's slots, ``t`` is the 1-based step count."""
    kind, wd = config.kind, config.weight_decay
    if kind is OptimizerKind.ADAMW:
        if wd:
            param *= 1.0 - lr * wd
    elif wd:
        grad += wd * param
    if kind is OptimizerKind.SGD:
        grad *= lr
        param -= grad
    elif kind in (OptimizerKind.MOMENTUM, OptimizerKind.NESTEROV):
        _momentum(xp, config, param, grad, state, lr, t)
    else:
        _adam(xp, config, param, grad, state, lr, t)


def _momentum(xp, config: OptimizerConfig, param, grad, state: dict, lr: float, t: int) -> None:
    buf = state["momentum"]
    if t == 1:
        buf[...] = grad
    else:
        buf *= config.momentum
        buf += grad
    if config.kind is OptimizerKind.NESTEROV:
        grad += config.momentum * buf
        step = grad
    else:
        step = buf
    param -= lr * step


def _adam(xp, config: OptimizerConfig, param, grad, state: dict, lr: float, t: int) -> None:
    beta1, beta2 = config.betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m *= beta1
    m += (1.0 - beta1) * grad
    v *= beta2
    v += (1.0 - beta2) * grad * grad
    correction1 = 1.0 - beta1**t
    correction2 = 1.0 - beta2**t
    denom = xp.sqrt(v) / math.sqrt(correction2)
    denom += config.eps
    param -= (lr / correction1) * (m / denom)
