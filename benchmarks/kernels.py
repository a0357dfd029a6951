"""Forward + backward time of every op of a model, one task per op, numpy vs cupy.

    python -m benchmarks.kernels [--model examples/cnn.onnx] [--batch 256] [--repeat 20]

Each op runs on its whole tensors (a one-device plan), from buffers cut the way the
executor cuts them; the table gives the median of ``--repeat`` runs after two warm-ups,
and the ratio numpy / cupy measured in the same run. Without cupy or a GPU only the numpy
column is filled.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import time

import numpy as np

from executor.buffers import slice_from_full
from executor.device import cupy_module
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph, TensorRole
from onnx2soap.ops import TaskArgs, definition
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.partition import rect_shape


def _inputs(graph: Graph, rng: np.random.Generator, dtype) -> dict[str, np.ndarray]:
    values = {}
    for name, t in graph.tensors.items():
        if t.role is TensorRole.LABELS:
            classes = graph.tensors[graph.loss_op.inputs[0]].shape[1]
            values[name] = rng.integers(0, classes, size=t.shape)
        else:
            values[name] = rng.standard_normal(t.shape).astype(dtype)
    return values


def _time(xp, run, repeat: int) -> float:
    sync = (lambda: xp.cuda.Device().synchronize()) if xp is not np else (lambda: None)
    for _ in range(2):
        run()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _step(xp, kernel, attrs, bufs, targs):
    """One forward and one backward of a task, as a closure to time."""
    out = kernel.forward(xp, attrs, bufs, targs)
    grad = xp.ones_like(out)

    def step() -> None:
        kernel.forward(xp, attrs, bufs, targs)
        kernel.backward(xp, attrs, bufs, out, grad, targs)

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="examples/cnn.onnx")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    graph = load_model(args.model, args.batch).graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    values = _inputs(graph, np.random.default_rng(0), np.float32)
    cp = cupy_module()  # None: no cupy, no driver or no GPU (numpy only)
    modules = [("numpy", np)] + ([("cupy", cp)] if cp is not None else [])
    print(f"{'op':<28}{'type':<26}" + "".join(f"{n + ' ms':>12}" for n, _ in modules) + "   ratio")
    totals = {n: 0.0 for n, _ in modules}
    for op in graph.ops:
        task = pg.tasks[op.name][0]
        kernel = definition(op.type)
        targs = TaskArgs(rect_shape(task.output), tuple(r.valid for r in task.inputs), args.batch)
        row = []
        for name, xp in modules:
            full = [xp.asarray(values[t]) for t in op.inputs]
            bufs = [slice_from_full(xp, a, r) for a, r in zip(full, task.inputs, strict=True)]
            seconds = _time(xp, _step(xp, kernel, op.attrs, bufs, targs), args.repeat)
            totals[name] += seconds
            row.append(seconds)
        ratio = f"{row[0] / row[1]:7.1f}x" if len(row) > 1 else ""
        cells = "".join(f"{s * 1e3:>12.3f}" for s in row)
        print(f"{op.name:<28}{op.type:<26}{cells} {ratio}")
    line = "".join(f"{t * 1e3:>12.3f}" for t in totals.values())
    ratio = f"{totals['numpy'] / totals['cupy']:7.1f}x" if cp is not None else ""
    print(f"{'total':<54}{line} {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
