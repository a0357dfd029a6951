"""Shards written at their places make the whole tensors, byte for byte: compared with
numpy's own row-major layout of the same arrays (``np.ravel_multi_index``, ``tofile``)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from executor.shard_io import ALIGN, Layout, contiguous_runs, read_placed, write_shards


def _rects(shape: tuple[int, ...], cuts: tuple[int, ...]):
    """The grid of Rects that cuts axis k into ``cuts[k]`` balanced pieces."""
    bounds = [np.array_split(np.arange(n), c) for n, c in zip(shape, cuts, strict=True)]
    for parts in itertools.product(*bounds):
        yield tuple((int(p[0]), int(p[-1]) + 1) for p in parts)


SHAPES = [
    ((6,), (3,)),
    ((5, 7), (2, 3)),
    ((5, 7), (1, 2)),
    ((4, 3, 5), (2, 1, 2)),
    ((2, 3, 4, 5), (1, 3, 1, 2)),
]


@pytest.mark.parametrize(("shape", "cuts"), SHAPES)
def test_runs_cover_each_rect_in_row_major_order(shape, cuts) -> None:
    for rect in _rects(shape, cuts):
        box = tuple(slice(lo, hi) for lo, hi in rect)
        local = np.arange(np.prod([hi - lo for lo, hi in rect])).reshape(
            [hi - lo for lo, hi in rect]
        )
        flat = np.ravel_multi_index(np.indices(shape)[(slice(None), *box)], shape)
        covered = np.full(flat.shape, -1)
        for start, index in contiguous_runs(shape, rect):
            run = local[index].reshape(-1)
            # the run is contiguous in the whole tensor from `start`
            positions = np.searchsorted(flat.reshape(-1), np.arange(start, start + run.size))
            assert np.array_equal(flat.reshape(-1)[positions], np.arange(start, start + run.size))
            covered.reshape(-1)[positions] = run
        np.testing.assert_array_equal(covered, local)


def test_shards_written_make_the_whole_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((5, 7)),
        "b": rng.standard_normal((4, 3, 5)).astype(np.float32),
        "scalar": np.array(3.5),
        "c": rng.standard_normal((6,)),
    }
    cuts = {"a": (2, 3), "b": (2, 1, 2), "scalar": (), "c": (3,)}
    # b is saved in float32 from float64 values, as a run in float64 saves a model
    layout = Layout.of(
        [(n, v.shape, np.float32 if n == "b" else np.float64) for n, v in tensors.items()]
    )
    assert all(p.offset % ALIGN == 0 for p in layout.tensors.values())
    owned = [
        (name, rect, value[tuple(slice(lo, hi) for lo, hi in rect)].astype(np.float64))
        for name, value in tensors.items()
        for rect in _rects(value.shape, cuts[name])
    ]
    path = tmp_path / "shards.bin"
    write_shards(MPI.COMM_SELF, path, layout, iter(owned[::-1]))  # any order
    assert path.stat().st_size == layout.size
    for name, value in tensors.items():
        placed = layout.tensors[name]
        read = np.frombuffer(b"".join(read_placed(path, placed, chunk_bytes=24)), placed.dtype)
        want = np.fromfile(path, dtype=placed.dtype, count=value.size, offset=placed.offset)
        np.testing.assert_array_equal(read, want)
        np.testing.assert_array_equal(read.reshape(value.shape), value.astype(placed.dtype))
