"""Which ops' statistics share a ring (``soap/stats_batches.py``): a run of ops with
statistics side by side, none reading another, sums its groups on the same devices in
one ring; dependent ones keep their own."""

from __future__ import annotations

from onnx2soap.soap.partition import StatGroup
from onnx2soap.soap.stats_batches import StatsRing, stats_rings, stats_runs
from tests.importer.test_stats_order import FakeGraph, ops_of


def test_runs_are_neighbours_none_reading_another() -> None:
    ops = ops_of("c1<x b1<c1 b2<x b3<b1 r<b3 b4<r b5<x")
    assert stats_runs(FakeGraph(tuple(ops))) == ((1, 2), (3,), (5, 6))


def group(devices: tuple[int, ...], tasks=(0,)) -> StatGroup:
    return StatGroup(tuple(tasks), devices, (3, 2))


def test_rings_gather_the_groups_on_each_device_set_in_run_order() -> None:
    stats = {
        4: (group((0, 1)), group((2, 3))),
        5: (group((2, 3)), group((0, 1)), group((1,))),
        6: (group((1,)),),
    }
    assert stats_rings((4, 5, 6), stats.__getitem__) == (
        StatsRing((0, 1), ((4, 0), (5, 1))),
        StatsRing((2, 3), ((4, 1), (5, 0))),
        # one device sums nothing: each such group keeps its own
        StatsRing((1,), ((5, 2),)),
        StatsRing((1,), ((6, 0),)),
    )
    # the backward's run comes reversed: its rings in the order their first ops come
    assert stats_rings((6, 5, 4), stats.__getitem__)[1:3] == (
        StatsRing((2, 3), ((5, 0), (4, 1))),
        StatsRing((0, 1), ((5, 1), (4, 0))),
    )


def test_a_rings_name_lists_its_ops_once_each() -> None:
    ring = StatsRing((0, 1), ((4, 0), (4, 1), (5, 0)))
    assert ring.name({4: "bn1", 5: "bn2"}.__getitem__, "fwd") == "stats bn1+bn2 fwd"
