"""PNG pictures drawn with matplotlib: the plan grid, the Gantt chart, the loss curves.

matplotlib is imported here only, when a picture is drawn (it is an optional extra).
Every picture is its own ``Figure`` on an Agg canvas: no pyplot, no ``matplotlib.use``,
nothing global. Figures are exactly the requested pixel size (no tight bounding box;
the constrained layout fits the labels inside it).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onnx2soap.errors import UserError
from onnx2soap.viz import NEEDS_MATPLOTLIB
from onnx2soap.viz.layout import SINGLE, Gantt, PlanGrid, short_name
from onnx2soap.viz.metrics import Metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

KIND_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "transfer": "#55a868",
    "allreduce": "#c44e52",
    "update": "#8172b3",
}
OTHER_COLOUR = "#999999"
SINGLE_COLOUR = "#b0b0b0"
MAX_LEGEND_SPLITS = 16  # more would not fit beside the grid; the rest are named "more"
LABEL_PITCH_PT = 11  # room one tick label needs across its axis


@dataclass(frozen=True)
class Size:
    width: int  # pixels
    height: int
    dpi: int


@dataclass(frozen=True)
class Picture:
    png: bytes
    # Where each cell of the plan grid landed, in pixels from the image's top left, in the
    # order of ``PlanGrid.cells`` (empty for pictures without a grid): what tests sample.
    cell_pixels: tuple[tuple[float, float], ...] = ()


def split_colours(splits: tuple[str, ...]) -> dict[str, tuple[float, float, float, float]]:
    """A colour per split label in legend order: grey for ``single``, then tab10's strong
    colours, then tab20's light ones (the palette repeats past 18 splits)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    strong = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]  # 7 is grey
    light = [c for i, c in enumerate(colormaps["tab20"].colors) if i % 2 and i != 15]
    palette = strong + light
    colours, k = {}, 0
    for split in splits:
        if split == SINGLE:
            colours[split] = to_rgba(SINGLE_COLOUR)
        else:
            colours[split] = to_rgba(palette[k % len(palette)])
            k += 1
    return colours


def _figure(size: Size) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # checked before the work; this is the last line of defence
        raise UserError(NEEDS_MATPLOTLIB) from e
    return Figure(figsize=(size.width / size.dpi, size.height / size.dpi), dpi=size.dpi)


def _png(fig: Figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    # No "Software" stamp: the same plan draws the same bytes on the same matplotlib.
    FigureCanvasAgg(fig).print_png(buffer, metadata={"Software": None})
    return buffer.getvalue()


# --- plan grid ------------------------------------------------------------------------------


def render_plan(grid: PlanGrid, gantt: Gantt | None, size: Size, title: str = "") -> Picture:
    """The plan grid, with the Gantt chart below it when ``gantt`` is given."""
    fig = _figure(size)
    fig.set_layout_engine("constrained")
    if gantt is None:
        grid_ax = fig.add_subplot()
    else:
        grid_ax, gantt_ax = fig.subplots(2, 1, height_ratios=(3, 2))
        draw_gantt(gantt_ax, gantt, size)
    draw_grid(grid_ax, grid, size, title)
    png = _png(fig)  # draws, and so fixes the layout that the pixels below are read from
    centres = [c.centre for c in grid.cells]
    pixels = grid_ax.transData.transform(centres) if centres else []
    return Picture(png, tuple((float(x), size.height - float(y)) for x, y in pixels))


def draw_grid(ax: Axes, grid: PlanGrid, size: Size, title: str) -> None:
    from matplotlib.collections import LineCollection, PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    colours = split_colours(grid.splits)
    # Lines under the cells: they show in the gaps, and never tint a cell's colour.
    lines = [(t.src, t.dst) for t in grid.transfers]
    ax.add_collection(LineCollection(lines, colors="#555555", linewidths=0.5, zorder=1))
    boxes = [_corners(c.x, c.y, c.width, c.height) for c in grid.cells]
    fill = [colours[c.split] for c in grid.cells]
    ax.add_collection(PolyCollection(boxes, facecolors=fill, edgecolors="none", zorder=2))
    ax.set_xlim(-0.6, len(grid.ops) - 0.4)
    ax.set_ylim(grid.devices - 0.5, -0.5)  # device 0 on top
    _op_ticks(ax, grid.ops, size)
    _device_ticks(ax, grid.devices, size)
    ax.set_xlabel("ops in graph order")
    ax.set_ylabel("device")
    handles = [Patch(color=colours[s], label=s) for s in grid.splits[:MAX_LEGEND_SPLITS]]
    if len(grid.splits) > MAX_LEGEND_SPLITS:
        handles.append(Patch(color="white", label=f"{len(grid.splits) - MAX_LEGEND_SPLITS} more"))
    handles.append(Line2D([], [], color="#555555", linewidth=0.5, label=_transfer_label(grid)))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    ax.set_title(title or f"{len(grid.cells)} tasks of {len(grid.ops)} ops", fontsize="medium")


def _transfer_label(grid: PlanGrid) -> str:
    if grid.transfers_total > len(grid.transfers):
        return f"transfers ({len(grid.transfers)} of {grid.transfers_total} drawn)"
    return f"transfers ({grid.transfers_total})"


def _corners(x: float, y: float, w: float, h: float) -> list[tuple[float, float]]:
    return [(x, y), (x + w, y), (x + w, y + h), (x, y + h)]


def _every(count: int, room_pt: float) -> int:
    """Label every k-th tick so that the labels fit in ``room_pt`` points."""
    fits = max(1, int(room_pt / LABEL_PITCH_PT))
    return max(1, math.ceil(count / fits))


def _op_ticks(ax: Axes, ops: tuple[str, ...], size: Size) -> None:
    k = _every(len(ops), size.width / size.dpi * 72 * 0.8)
    ticks = range(0, len(ops), k)
    ax.set_xticks(list(ticks), [short_name(ops[i]) for i in ticks], rotation=60, ha="right")
    ax.tick_params(axis="x", labelsize="x-small")


def _device_ticks(ax: Axes, devices: int, size: Size) -> None:
    k = _every(devices, size.height / size.dpi * 72 * 0.5)
    ax.set_yticks(list(range(0, devices, k)))
    ax.tick_params(axis="y", labelsize="x-small")


# --- Gantt chart ----------------------------------------------------------------------------


def render_gantt(gantt: Gantt, size: Size) -> Picture:
    fig = _figure(size)
    fig.set_layout_engine("constrained")
    draw_gantt(fig.add_subplot(), gantt, size)
    return Picture(_png(fig))


def draw_gantt(ax: Axes, gantt: Gantt, size: Size) -> None:
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    scale, unit = _time_unit(gantt.makespan)
    boxes = [
        _corners(b.start * scale, b.row - 0.4, (b.end - b.start) * scale, 0.8) for b in gantt.bars
    ]
    fill = [KIND_COLOURS.get(b.kind, OTHER_COLOUR) for b in gantt.bars]
    # A thin edge of the bar's own colour: a 1 µs task in a 10 ms step is still seen.
    ax.add_collection(PolyCollection(boxes, facecolors=fill, edgecolors=fill, linewidths=0.3))
    ax.set_xlim(0, max(gantt.makespan * scale, 1e-9))
    ax.set_ylim(len(gantt.rows) - 0.5, -0.5)
    k = _every(len(gantt.rows), size.height / size.dpi * 72 * 0.4)
    ticks = range(0, len(gantt.rows), k)
    ax.set_yticks(list(ticks), [gantt.rows[i] for i in ticks])
    ax.tick_params(axis="y", labelsize="x-small")
    ax.set_xlabel(f"time ({unit})")
    handles = [Patch(color=KIND_COLOURS.get(k, OTHER_COLOUR), label=k) for k in gantt.kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    ax.set_title(f"simulated step: {gantt.makespan * scale:.4g} {unit}", fontsize="medium")


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


# --- loss curves ----------------------------------------------------------------------------


def render_metrics(metrics: Metrics, size: Size, title: str = "") -> Picture:
    """Training loss and evaluation loss against step; accuracy on a second axis."""
    fig = _figure(size)
    fig.set_layout_engine("constrained")
    ax = fig.add_subplot()
    lines = []
    if metrics.train:
        steps, losses = zip(*((p.step, p.loss) for p in metrics.train), strict=True)
        lines += ax.plot(steps, losses, color=KIND_COLOURS["forward"], lw=1, label="loss")
    if metrics.eval:
        steps, losses = zip(*((p.step, p.loss) for p in metrics.eval), strict=True)
        style = {"color": KIND_COLOURS["backward"], "marker": "o", "ms": 3, "lw": 1}
        lines += ax.plot(steps, losses, label="eval loss", **style)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lines += _accuracy(ax, metrics)
    fig.legend(handles=lines, loc="outside lower center", ncols=len(lines), fontsize="small")
    note = f" ({metrics.nonfinite} non-finite losses not drawn)" if metrics.nonfinite else ""
    ax.set_title((title or "training") + note, fontsize="medium")
    return Picture(_png(fig))


def _accuracy(ax: Axes, metrics: Metrics) -> list:
    points = [(p.step, p.accuracy) for p in metrics.eval if p.accuracy is not None]
    if not points:
        return []
    twin = ax.twinx()
    steps, accuracy = zip(*points, strict=True)
    style = {"color": KIND_COLOURS["transfer"], "marker": "s", "ms": 3, "lw": 1}
    lines = twin.plot(steps, accuracy, label="eval accuracy", **style)
    twin.set_ylabel("accuracy")
    finite = [a for a in accuracy if math.isfinite(a)]
    if finite and min(finite) >= 0 and max(finite) <= 1:
        twin.set_ylim(0, 1)
    return lines
