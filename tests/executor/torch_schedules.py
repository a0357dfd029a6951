"""Every ``--lr-schedule`` with its warm-up, as a torch user writes it with
``torch.optim.lr_scheduler`` (the independent reference for ``OptimizerConfig.lr_factor``):
warm-up by ``LinearLR`` from 1/K over K - 1 scheduler steps, then ``CosineAnnealingLR``
or ``LinearLR`` down to 0 over the steps left, joined by ``SequentialLR`` at step K; one
scheduler step after each optimizer step."""

from __future__ import annotations

from executor.optim import Schedule


def torch_scheduler(optimizer, schedule: Schedule, warmup: int, total: int):
    """The scheduler for ``total`` steps (None: the rate never changes)."""
    from torch.optim import lr_scheduler

    after = total - warmup
    if schedule is Schedule.COSINE:
        decay = lr_scheduler.CosineAnnealingLR(optimizer, T_max=after)
    elif schedule is Schedule.LINEAR:
        decay = lr_scheduler.LinearLR(
            optimizer, start_factor=1.0, end_factor=0.0, total_iters=after
        )
    else:
        decay = None
    if warmup == 0:
        return decay
    # K steps from 1/K to 1 (a warm-up of one step is the full rate at once)
    warm = lr_scheduler.LinearLR(
        optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=max(warmup - 1, 1)
    )
    if decay is None:
        return warm
    return lr_scheduler.SequentialLR(optimizer, [warm, decay], milestones=[warmup])
