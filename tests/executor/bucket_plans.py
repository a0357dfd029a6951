"""Plans of the example CNN whose weight gradients are summed in several buckets
(soap/buckets.py), for the bucket tests on CPU ranks and on GPUs."""

from __future__ import annotations

import math
from pathlib import Path

from onnx2soap.importer import file_sha256, load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import ParallelConfig, Partitioner, Plan, Strategy, analyze, plan_ops, save_plan
from onnx2soap.soap.buckets import BucketRing, all_rings, gradient_buckets

BATCH = 6
# 2 KiB: the example CNN's five weight ops fill four buckets, fc2, fc1, the two branch
# convolutions together, conv1 (by hand: tests/soap/test_buckets.py)
BUCKET_MB = 2 / 1024


def mixed(graph, space, ranks: int = 3) -> Strategy:
    """Data parallelism over the ranks, but for the two branch convolutions, which share
    a bucket: branch_b's samples over ranks 0 and 1, and branch_a's samples and output
    channels over 2 x 2 tasks on ranks 0, 1, 1, 2, so that its two halves of channels
    are replicated over (0, 1) and (1, 2). The bucket is then summed by two rings, that
    over (0, 1) holding both convolutions' gradients."""
    strategy = data_parallel(graph, space, ranks)
    split = {
        "/branch_b/conv/Conv": ({"n": 2}, (0, 1)),
        "/branch_a/conv/Conv": ({"n": 2, "co": 2}, (0, 1, 1, 2)),
    }
    for name, (want, devices) in split.items():
        degrees = tuple(want.get(d.name, 1) for d in space[name])
        assert math.prod(degrees) == len(devices)
        strategy = strategy.replace(name, ParallelConfig(degrees, devices))
    return strategy


def save(model: Path, path: Path, strategy: Strategy, bucket_mb: float = BUCKET_MB) -> Path:
    graph = load_model(model, BATCH).graph
    ops = plan_ops(strategy, graph, analyze(graph))
    plan = Plan(
        model, file_sha256(model), BATCH, graph.loss, strategy.devices, ops, bucket_mb=bucket_mb
    )
    save_plan(plan, path)
    return path


def rings(model: Path, strategy: Strategy, bucket_mb: float = BUCKET_MB) -> list[BucketRing]:
    """The plan's buckets' rings, in the order they start."""
    graph = load_model(model, BATCH).graph
    pg = Partitioner(graph).partition(strategy)
    by_op = all_rings(gradient_buckets(graph, bucket_mb), lambda i: pg.groups[graph.ops[i].name])
    return [r for i in sorted(by_op, reverse=True) for r in by_op[i]]


def strategy(model: Path, kind: str, ranks: int) -> Strategy:
    """``kind``: "data-parallel" over ``ranks``, or "mixed" (``mixed``) over 3."""
    graph = load_model(model, BATCH).graph
    space = analyze(graph)
    if kind == "mixed":
        assert ranks == 3
        return mixed(graph, space)
    return data_parallel(graph, space, ranks)
