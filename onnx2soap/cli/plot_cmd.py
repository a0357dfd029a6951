"""``onnx2soap plot run.jsonl -o loss.png``: a run's loss and evaluation curves.

``run.jsonl`` is what ``python -m executor run --metrics run.jsonl`` writes: training
lines (step, loss, ...) and evaluation lines (step, eval_loss, eval_accuracy when the
task is a classification); see ``onnx2soap.viz.metrics`` for the format.
"""

from __future__ import annotations

import argparse

from onnx2soap.cli.picture_options import add_picture_options, picture_size
from onnx2soap.files import check_output, write_atomic
from onnx2soap.viz import require_matplotlib
from onnx2soap.viz.metrics import read_metrics


def register(sub) -> None:
    p = sub.add_parser("plot", help="draw a run's loss and evaluation curves as a PNG")
    p.add_argument("metrics", help="metrics file written by executor run --metrics (JSON lines)")
    add_picture_options(p, default=(1000, 600))
    p.add_argument("--title", default="", help="the picture's title (default: the file name)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require_matplotlib()
    check_output(args.output)  # before reading a long run, not after it
    from onnx2soap.viz.render import render_metrics

    metrics = read_metrics(args.metrics)
    title = args.title or str(args.metrics)
    write_atomic(args.output, render_metrics(metrics, picture_size(args), title).png)
    print(f"{args.output}: {len(metrics.train)} training and {len(metrics.eval)} evaluation points")
    return 0
