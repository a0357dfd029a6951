"""Weight replica groups: per weight, the groups partition the op's tasks; a group's
tasks read one Rect, different groups read different Rects, the Rects cover the weight,
and a group's devices are its tasks' distinct devices, sorted."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx2soap.ir import Op
from onnx2soap.soap.partition import (
    ParallelConfig,
    ReplicaGroup,
    Task,
    op_tasks,
    replica_groups,
)
from tests.soap.builders import (
    Window,
    conv_op,
    conv_shapes,
    coverage,
    gemm_op,
    op_configs,
    windows,
)


def check_groups(
    op: Op,
    tasks: Sequence[Task],
    groups: Sequence[ReplicaGroup],
    weights: Sequence[int],
    shapes: Sequence[Sequence[int]],
) -> None:
    assert {g.operand for g in groups} == set(weights)
    for operand in weights:
        mine = [g for g in groups if g.operand == operand]
        members = sorted(i for g in mine for i in g.tasks)
        assert members == list(range(len(tasks))), "every task in exactly one group"
        rects = [g.rect for g in mine]
        assert len(set(rects)) == len(rects), "different groups read different rects"
        for g in mine:
            assert g.weight == op.inputs[operand]
            assert g.tasks, "no empty group"
            assert {tasks[i].inputs[operand].data for i in g.tasks} == {g.rect}
            assert g.devices == tuple(sorted({tasks[i].device for i in g.tasks}))
        cover = coverage(shapes[operand], rects)
        assert (cover >= 1).all(), "the group rects cover the weight"
        # weights are read one-to-one (identity maps): group rects tile the weight
        assert (cover == 1).all()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_gemm_replica_groups(data: st.DataObject) -> None:
    n, ci, co = (data.draw(st.integers(1, 6)) for _ in range(3))
    op = gemm_op("g", "x", "w", "b", "y", n, ci, co)
    shapes = [(n, ci), (ci, co), (co,)]
    config = data.draw(op_configs(op, devices=data.draw(st.integers(1, 8)), max_degree=6))
    tasks = op_tasks(op, config, shapes)
    groups = replica_groups(op, tasks, [1, 2])
    check_groups(op, tasks, groups, [1, 2], shapes)
    # every n-chunk replicates every co-chunk of the weight: co-degree groups of n-degree
    n_deg, co_deg, _ = config.degrees
    for operand in (1, 2):
        mine = [g for g in groups if g.operand == operand]
        assert len(mine) == co_deg
        assert all(len(g.tasks) == n_deg for g in mine)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_conv_replica_groups(data: st.DataObject) -> None:
    win = data.draw(windows(8))
    n, ci, co = (data.draw(st.integers(1, 4)) for _ in range(3))
    op = conv_op("c", "x", "w", "b", "y", n, ci, co, [win])
    s = conv_shapes(n, ci, co, [win])
    shapes = [s["x"], s["weight"], s["bias"]]
    config = data.draw(op_configs(op, max_degree=4))
    tasks = op_tasks(op, config, shapes)
    check_groups(op, tasks, replica_groups(op, tasks, [1, 2]), [1, 2], shapes)


def test_gemm_groups_known_case() -> None:
    # n split 2, co split 2: tasks (n0,co0)=0 (n0,co1)=1 (n1,co0)=2 (n1,co1)=3
    op = gemm_op("g", "x", "w", None, "y", 4, 3, 6)
    config = ParallelConfig((2, 2, 1), (5, 1, 1, 0))
    tasks = op_tasks(op, config, [(4, 3), (3, 6)])
    groups = replica_groups(op, tasks, [1])
    assert [(g.weight, g.rect, g.tasks, g.devices) for g in groups] == [
        ("w", ((0, 3), (0, 3)), (0, 2), (1, 5)),
        ("w", ((0, 3), (3, 6)), (1, 3), (0, 1)),
    ]


def test_unsplit_weight_is_one_group_over_all_devices() -> None:
    op = gemm_op("g", "x", "w", "b", "y", 8, 3, 2)
    config = ParallelConfig((4, 1, 1), (3, 0, 3, 2))
    tasks = op_tasks(op, config, [(8, 3), (3, 2), (2,)])
    groups = replica_groups(op, tasks, [1, 2])
    assert [(g.operand, g.rect, g.tasks, g.devices) for g in groups] == [
        (1, ((0, 3), (0, 2)), (0, 1, 2, 3), (0, 2, 3)),
        (2, ((0, 2),), (0, 1, 2, 3), (0, 2, 3)),
    ]
    assert np.array_equal(coverage((3, 2), [groups[0].rect]), np.ones((3, 2)))


def test_window_weight_known_case() -> None:
    win = Window(5, 3, pad_begin=1, pad_end=1)
    op = conv_op("c", "x", "w", None, "y", 2, 2, 4, [win])
    # degrees n=2, co=2, l=1: weight rects by co
    config = ParallelConfig((2, 2, 1, 1, 1), (0, 1, 2, 3))
    tasks = op_tasks(op, config, [(2, 2, 5), (4, 2, 3)])
    groups = replica_groups(op, tasks, [1])
    assert [(g.rect, g.tasks, g.devices) for g in groups] == [
        (((0, 2), (0, 2), (0, 3)), (0, 2), (0, 2)),
        (((2, 4), (0, 2), (0, 3)), (1, 3), (1, 3)),
    ]
