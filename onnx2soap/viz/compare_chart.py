"""The ``compare --chart`` picture: per op and phase, predicted and measured time side by
side (horizontal bars, the ops that take longest measured first)."""

from __future__ import annotations

from onnx2soap.sim.compare import Comparison
from onnx2soap.viz.render import KIND_COLOURS, Size, _figure, _png

MAX_BARS = 40  # more would not be readable; the rest are summed into one bar


def render_comparison(comparison: Comparison, size: Size, title: str = "") -> bytes:
    fig = _figure(size)
    fig.set_layout_engine("constrained")
    ax = fig.add_subplot()
    rows = list(comparison.rows[:MAX_BARS])
    labels = [f"{r.op} {r.phase}" for r in rows]
    predicted = [r.predicted_s * 1e3 for r in rows]
    measured = [r.measured_s * 1e3 for r in rows]
    rest = comparison.rows[MAX_BARS:]
    if rest:
        labels.append(f"{len(rest)} more")
        predicted.append(sum(r.predicted_s for r in rest) * 1e3)
        measured.append(sum(r.measured_s for r in rest) * 1e3)
    ys = range(len(labels))
    height = 0.4
    ax.barh(
        [y - height / 2 for y in ys],
        predicted,
        height,
        label="predicted",
        color=KIND_COLOURS["forward"],
    )
    ax.barh(
        [y + height / 2 for y in ys],
        measured,
        height,
        label="measured (median step)",
        color=KIND_COLOURS["backward"],
    )
    ax.set_yticks(list(ys), labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (all tasks of the op, all devices)")
    ax.legend(loc="lower right", fontsize="small")
    step = (
        f"step: predicted {comparison.predicted_step_s * 1e3:.2f} ms, "
        f"measured {comparison.measured_step_s * 1e3:.2f} ms"
    )
    ax.set_title(f"{title}\n{step}" if title else step, fontsize="medium")
    return _png(fig)
