"""Candidate configs: every one validates, its task count divides D, its devices are an
aligned block, and the count matches enumeration by hand."""

from __future__ import annotations

import math
from itertools import product

from hypothesis import given, settings
from hypothesis import strategies as st

from onnx2soap.soap.candidates import candidates
from onnx2soap.soap.dims import DimKind, SoapDim, analyze
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.strategy import validate_config
from tests.soap.builders import small_cnn


def dim(name: str, size: int, splittable: bool) -> SoapDim:
    kind = DimKind.ATTRIBUTE if splittable else DimKind.REDUCTION
    return SoapDim(name, size, kind, 0 if splittable else None, splittable)


@st.composite
def dim_lists(draw) -> list[SoapDim]:
    count = draw(st.integers(1, 4))
    return [dim(f"d{i}", draw(st.integers(1, 9)), draw(st.booleans())) for i in range(count)]


def brute_force_count(dims: list[SoapDim], devices: int) -> int:
    total = 0
    ranges = [range(1, d.size + 1) if d.splittable else range(1, 2) for d in dims]
    for degrees in product(*ranges):
        p = math.prod(degrees)
        if devices % p == 0:
            total += devices // p  # one aligned block per start
    return total


@settings(max_examples=200, deadline=None)
@given(dim_lists(), st.integers(1, 16))
def test_candidates_are_valid_aligned_and_complete(dims: list[SoapDim], devices: int) -> None:
    found = candidates(dims, devices)
    assert len(set(found)) == len(found), "no duplicates"
    assert len(found) == brute_force_count(dims, devices)
    for config in found:
        validate_config("op", tuple(dims), config, devices)
        p = config.tasks
        assert math.prod(config.degrees) == p
        assert devices % p == 0
        start = config.devices[0]
        assert start % p == 0
        assert config.devices == tuple(range(start, start + p))


def test_known_count() -> None:
    # n (8, splittable), co (2, splittable), ci (16, not) on 4 devices:
    # p=1: (1,1,1) x 4 blocks; p=2: (2,1,1), (1,2,1) x 2 blocks; p=4: (4,1,1), (2,2,1) x 1
    dims = [dim("n", 8, True), dim("co", 2, True), dim("ci", 16, False)]
    got = candidates(dims, 4)
    assert len(got) == 4 + 4 + 2
    assert set(got) == {
        *(ParallelConfig((1, 1, 1), (d,)) for d in range(4)),
        ParallelConfig((2, 1, 1), (0, 1)),
        ParallelConfig((2, 1, 1), (2, 3)),
        ParallelConfig((1, 2, 1), (0, 1)),
        ParallelConfig((1, 2, 1), (2, 3)),
        ParallelConfig((4, 1, 1), (0, 1, 2, 3)),
        ParallelConfig((2, 2, 1), (0, 1, 2, 3)),
    }


def test_nothing_splittable_leaves_one_task_per_device() -> None:
    dims = [dim("a", 5, False), dim("b", 1, True)]
    assert candidates(dims, 6) == tuple(ParallelConfig((1, 1), (d,)) for d in range(6))


def test_candidates_of_a_graph_validate() -> None:
    space = analyze(small_cnn())
    for name, dims in space.items():
        for config in candidates(dims, 8):
            validate_config(name, dims, config, 8)
    # relu: n (4), c (7), l (10) on 8 devices, counted by hand over divisors 1, 2, 4, 8
    assert len(candidates(space["relu"], 8)) == brute_force_count(list(space["relu"]), 8)
    # 1 task: 8 blocks; 2: n|c|l = 3 vectors x 4; 4: (4,1,1) (2,2,1) (2,1,2) (1,4,1)
    # (1,2,2) (1,1,4) = 6 x 2; 8: (4,2,1) (4,1,2) (2,4,1) (2,2,2) (2,1,4) (1,4,2) (1,2,4)
    # (1,1,8) = 8 x 1  [c=7 excludes 8 on c; n=4 excludes 8 on n]
    assert len(candidates(space["relu"], 8)) == 8 + 12 + 12 + 8


def test_reduction_splits_are_candidates_where_partial_sums_are_allowed(example_onnx) -> None:
    """A Conv's and a Gemm's contraction (partial sums) are among the moves, a window's
    kernel positions and the loss's classes are not (no partial sums for them)."""
    from onnx2soap.importer import load_model

    graph = load_model(example_onnx, 8).graph
    space = analyze(graph)
    summed = set()
    for op in graph.ops:
        for config in candidates(space[op.name], 4):
            for d, k in zip(space[op.name], config.degrees, strict=True):
                if k > 1 and d.kind is DimKind.REDUCTION:
                    summed.add((op.type, d.name))
    assert summed == {("Conv", "ci"), ("Gemm", "ci")}
