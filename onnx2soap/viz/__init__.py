"""Pictures of plans, simulated steps and training runs (``onnx2soap show`` and ``plot``).

    layout.plan_grid(pg, space)           the plan grid's cells (one per task) and transfers
    layout.gantt_chart(tg, timeline, m)   the simulated step's bars, a row per device and link
    metrics.read_metrics(path)            a run's training and evaluation points (run.jsonl)
    render.render_plan / render_metrics   PNG bytes, drawn with matplotlib

``layout`` and ``metrics`` are pure and need no matplotlib; ``render`` imports it when it
draws (matplotlib is the optional ``plots`` extra), always on Agg and on its own
``Figure`` objects, never through pyplot's global state.
"""

from __future__ import annotations

import importlib.util

from onnx2soap.errors import UserError

NEEDS_MATPLOTLIB = "needs matplotlib: pip install 'onnx2soap[plots]'"


def require_matplotlib() -> None:
    """Refuse (one line, exit 2) before any work when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError(NEEDS_MATPLOTLIB)
