"""Which sum groups reduce-scatter (soap/sum_scatter.py), on hand-made tasks: a tile of
8 rows x 6 columns summed over devices 0 and 1, read by readers placed by hand."""

from __future__ import annotations

from onnx2soap.soap.partition import Rect, Region, Scatter, SumGroup, Task
from onnx2soap.soap.sum_scatter import scattered

TILE: Rect = ((0, 8), (0, 6))
GROUP = SumGroup(tasks=(0, 1), devices=(0, 1), numel=48, holders=(0, 1), tile=TILE)


def reader(index: int, device: int, rect: Rect) -> Task:
    region = Region(rect, rect, None)
    return Task("relu", index, device, rect, rect, (region,))


def decide(*tasks: Task) -> Scatter | None:
    (group,) = scattered((GROUP,), [(tasks, 0)])
    return group.scatter


def test_readers_of_disjoint_rows_get_row_blocks_covering_the_tile() -> None:
    # device 1 reads rows 1-3, device 0 rows 5-7: the blocks follow the readers' order
    got = decide(reader(0, 1, ((1, 3), (0, 6))), reader(1, 0, ((5, 7), (0, 6))))
    assert got == Scatter(0, (((3, 8), (0, 6)), ((0, 3), (0, 6))))
    assert got.runs(TILE) == ((18, 48), (0, 18)) and got.in_place(TILE)


def test_rows_shared_but_columns_apart_cut_the_columns() -> None:
    got = decide(reader(0, 0, ((0, 8), (0, 2))), reader(1, 1, ((0, 8), (2, 6))))
    assert got == Scatter(1, (((0, 8), (0, 2)), ((0, 8), (2, 6))))
    # the ring's layout has the columns first: device 0's 2 columns of 8 rows, then 1's
    assert got.runs(TILE) == ((0, 16), (16, 48)) and not got.in_place(TILE)


def test_a_reader_off_the_group_does_not_stop_the_scatter() -> None:
    got = decide(
        reader(0, 0, ((0, 3), (0, 6))),
        reader(1, 1, ((3, 5), (0, 6))),
        reader(2, 2, ((5, 8), (0, 6))),
    )
    assert got == Scatter(0, (((0, 3), (0, 6)), ((3, 8), (0, 6))))


def test_overlapping_needs_a_member_without_reader_or_no_reader_keep_the_all_reduce() -> None:
    assert decide(reader(0, 0, ((0, 5), (0, 4))), reader(1, 1, ((3, 8), (2, 6)))) is None
    assert decide(reader(0, 0, ((0, 4), (0, 6))), reader(1, 2, ((4, 8), (0, 6)))) is None
    assert decide() is None
    # a reader that reads the whole tile on every member: an all-reduce's case
    assert decide(reader(0, 0, TILE), reader(1, 1, TILE)) is None
