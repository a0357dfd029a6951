"""What the pictures draw, as plain data: no matplotlib here, so tests can count it.

The plan grid puts op i (graph order) at x = i and device d at y = d; each task is one
cell inside the slot (i, d), several tasks of one op on one device stacked in it. The
Gantt chart has a row per device and per link the step uses, a bar per task and
resource it holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from onnx2soap.sim.machine import Machine
from onnx2soap.sim.simulate import Timeline
from onnx2soap.sim.taskgraph import TaskGraph, TaskKind
from onnx2soap.soap import PartitionedGraph, SoapDim

SINGLE = "single"  # the split label of an op run as one task
CELL_WIDTH = 0.8  # of a slot, leaving gaps where the transfer lines show
CELL_HEIGHT = 0.8
STACK_GAP = 0.1  # of one stacked cell's share of the slot height
MAX_TRANSFERS = 2000  # lines beyond it would hide the cells and take minutes to draw
MAX_NAME_CHARS = 18


@dataclass(frozen=True)
class Cell:
    """One task: op ``op`` (graph order), its ``task`` index, drawn at (x, y, w, h)."""

    op: int
    task: int
    device: int
    split: str
    x: float
    y: float
    width: float
    height: float

    @property
    def centre(self) -> tuple[float, float]:
        return self.x + self.width / 2, self.y + self.height / 2


@dataclass(frozen=True)
class Transfer:
    """A line from a producer cell's right edge to a consumer cell's left edge."""

    src: tuple[float, float]
    dst: tuple[float, float]


@dataclass(frozen=True)
class PlanGrid:
    ops: tuple[str, ...]  # full names, graph order
    devices: int
    splits: tuple[str, ...]  # labels in order of first appearance: the legend's order
    cells: tuple[Cell, ...]  # one per task, op by op
    transfers: tuple[Transfer, ...]  # at most max_transfers of them
    transfers_total: int  # distinct producer -> consumer cell pairs across devices


def split_label(dims: Sequence[SoapDim], degrees: Sequence[int]) -> str:
    """``n4``, ``n2·c2``: the split dims and degrees in the op's dim order."""
    parts = [f"{d.name}{k}" for d, k in zip(dims, degrees, strict=True) if k > 1]
    return "·".join(parts) or SINGLE


def short_name(name: str, limit: int = MAX_NAME_CHARS) -> str:
    """An op name for an axis label: its end, which is the most specific part."""
    name = name.lstrip("/") or name
    return name if len(name) <= limit else "…" + name[-(limit - 1) :]


def plan_grid(
    pg: PartitionedGraph,
    space: Mapping[str, tuple[SoapDim, ...]],
    max_transfers: int = MAX_TRANSFERS,
) -> PlanGrid:
    """The cells (exactly one per task of ``pg``) and transfer lines of the plan grid."""
    cells: list[Cell] = []
    splits: dict[str, None] = {}  # an ordered set
    for i, op in enumerate(pg.graph.ops):
        split = split_label(space[op.name], pg.strategy[op.name].degrees)
        splits.setdefault(split)
        cells.extend(_op_cells(i, pg.tasks[op.name], split))
    transfers, total = _transfers(pg, cells, max_transfers)
    return PlanGrid(
        ops=tuple(op.name for op in pg.graph.ops),
        devices=pg.strategy.devices,
        splits=tuple(splits),
        cells=tuple(cells),
        transfers=transfers,
        transfers_total=total,
    )


def _op_cells(op: int, tasks: Sequence, split: str) -> list[Cell]:
    by_device: dict[int, list[int]] = {}
    for t in tasks:
        by_device.setdefault(t.device, []).append(t.index)
    cells = []
    for device, indices in by_device.items():
        share = CELL_HEIGHT / len(indices)
        for slot, index in enumerate(indices):
            y = device - CELL_HEIGHT / 2 + slot * share + share * STACK_GAP / 2
            x = op - CELL_WIDTH / 2
            cells.append(Cell(op, index, device, split, x, y, CELL_WIDTH, share * (1 - STACK_GAP)))
    cells.sort(key=lambda c: c.task)
    return cells


def _transfers(
    pg: PartitionedGraph, cells: Sequence[Cell], limit: int
) -> tuple[tuple[Transfer, ...], int]:
    """Lines for the moves that cross devices, one per pair of cells (a tile split across
    several overlaps is still one line); past ``limit``, an evenly spaced sample of them,
    so that every part of the graph keeps some lines."""
    index = {name: i for i, name in enumerate(op.name for op in pg.graph.ops)}
    cell = {(c.op, c.task): c for c in cells}
    pairs: dict[tuple[tuple[int, int], tuple[int, int]], None] = {}
    for edge, _, src, dst in pg.moves():
        if src.device != dst.device:
            pairs.setdefault(((index[edge.producer], src.index), (index[edge.consumer], dst.index)))
    every = list(pairs)
    if len(every) > limit:
        every = [every[i * len(every) // limit] for i in range(limit)]
    lines = []
    for a, b in every:
        p, c = cell[a], cell[b]
        lines.append(Transfer((p.x + p.width, p.centre[1]), (c.x, c.centre[1])))
    return tuple(lines), len(pairs)


# --- the simulated step ---------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    row: int
    start: float
    end: float
    kind: str  # forward, backward, transfer, allreduce, update


@dataclass(frozen=True)
class Gantt:
    rows: tuple[str, ...]  # device names, then the links the step uses
    bars: tuple[Bar, ...]
    makespan: float
    kinds: tuple[str, ...]  # the kinds present, in TaskKind order: the legend


def kind_name(code: int) -> str:
    try:
        return TaskKind(code).name.lower()
    except ValueError:  # a kind newer than this module: drawn, in a neutral colour
        return f"kind {code}"


def gantt_chart(tg: TaskGraph, timeline: Timeline, machine: Machine) -> Gantt:
    """A bar per task on every resource it holds (a transfer holds its route's links, and
    on machines whose cores copy messages, both end devices too)."""
    devices = machine.size
    used = sorted({int(r) for r in tg.res_idx if r >= devices})
    row = {r: r for r in range(devices)} | {r: devices + j for j, r in enumerate(used)}
    links = [machine.resource_name(r) for r in used]  # links, and cores ranks share
    bars = []
    for i in range(len(tg.kind)):
        kind = kind_name(int(tg.kind[i]))
        start, end = float(timeline.start[i]), float(timeline.end[i])
        for r in tg.res_idx[tg.res_ptr[i] : tg.res_ptr[i + 1]]:
            bars.append(Bar(row[int(r)], start, end, kind))
    present = {b.kind for b in bars}
    order = [k.name.lower() for k in TaskKind] + sorted(present)
    return Gantt(
        rows=tuple(d.name for d in machine.devices) + tuple(links),
        bars=tuple(bars),
        makespan=max((b.end for b in bars), default=0.0),
        kinds=tuple(dict.fromkeys(k for k in order if k in present)),
    )
