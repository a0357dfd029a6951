"""``plan``'s pipeline and recomputation options: ``--strategy pipeline --stages S
--microbatches M [--schedule 1f1b|gpipe]``, ``--recompute``. The plans they ask for are
built by search/piped.py.
"""

from __future__ import annotations

import argparse

from onnx2soap.options import int_in
from onnx2soap.search.pipeline_rule import Recompute
from onnx2soap.soap.pipeline import SCHEDULES
from onnx2soap.soap.plan import MAX_BATCH, MAX_DEVICES

RECOMPUTE = tuple(m.value for m in Recompute)


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stages",
        type=int_in(1, MAX_DEVICES),
        help="with --strategy pipeline: pipeline stages, each on its own contiguous group of "
        "devices (default: one per node, at least 2)",
    )
    p.add_argument(
        "--microbatches",
        type=int_in(1, MAX_BATCH),
        help="with --strategy pipeline: microbatches per step, a divisor of the batch (default: "
        "the most, up to 4 per stage, whose samples fill a stage's devices)",
    )
    p.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        help="with --strategy pipeline: the order of each stage's passes (default 1f1b)",
    )
    p.add_argument(
        "--recompute",
        choices=list(RECOMPUTE),
        default="none",
        help="all: keep a checkpoint per repeated block (the ops whose outputs cross a "
        "transformer layer's or a ResNet block's boundary, as Megatron-LM's full "
        "recomputation keeps each layer's input), or without repeated blocks about sqrt(n) "
        "ops evenly spaced by simulated time (Chen et al. 2016), and recompute every other "
        "op but the loss: each segment's activations are made again during its backward. "
        "Less memory, one more forward per step. selective: keep the products' outputs "
        "(MatMul, Gemm, Conv) and recompute the cheap ops between them (norms, "
        "activations, dropout, elementwise), as Megatron-LM's selective recomputation. "
        "selective-op: that, and every second MatMul/Gemm of each repeated block too, "
        "as torchtitan's per-op policy (selective_ac_option = 'op') does",
    )
