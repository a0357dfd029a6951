"""A causal attention task's work, as the simulator counts it (``LoopNest.causal``,
``work_points``), against a brute-force count of the (query, key) pairs and against the
blocks the kernel (``ops/flash.py``) actually visits; the whole op's FLOPs stay half the
square plus the diagonal's blocks; a mask given as a tensor is not skipped by."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.ir import LoopNest
from onnx2soap.ops import flash


def _brute(rows: tuple[int, int], keys: tuple[int, int], block: int) -> int:
    """Pairs (i, j), j in ``keys``, of each block of queries from rows[0]: j at most the
    block's last query."""
    count = 0
    for start in range(rows[0], rows[1], block):
        last = min(rows[1], start + block) - 1
        for _ in range(start, last + 1):
            count += sum(1 for j in range(*keys) if j <= last)
    return count


def test_the_count_is_the_triangle_by_blocks_of_rows() -> None:
    for lo, hi, k0, k1, block in itertools.product(
        range(7), range(10), (0, 3), (4, 9, 16), (1, 2, 3, 5, 128)
    ):
        assert LoopNest.causal_pairs((lo, hi), (k0, k1), block) == _brute(
            (lo, hi), (k0, k1), block
        ), (lo, hi, k0, k1, block)
    # by single rows it is exactly the triangle: query i sees i + 1 keys
    assert LoopNest.causal_pairs((0, 64), (0, 64), 1) == 64 * 65 // 2
    assert LoopNest.causal_pairs((10, 20), (0, 64), 1) == sum(i + 1 for i in range(10, 20))


class _Visits:
    """Counts the (query, key) pairs of every tile the kernel computes."""

    def __init__(self, monkeypatch) -> None:
        self.pairs = 0
        spans = flash._Tiles.key_spans

        def counted(tiles, rows):
            for cols in spans(tiles, rows):
                self.pairs += (rows[1] - rows[0]) * (cols[1] - cols[0])
                yield cols

        monkeypatch.setattr(flash._Tiles, "key_spans", counted)


@pytest.mark.parametrize("block_q, block_k", ((3, 5), (4, 4), (1, 7)))
@pytest.mark.parametrize("rows", ((0, 40), (0, 9), (31, 40), (7, 23)))
def test_the_count_is_the_kernels_block_visits(monkeypatch, rows, block_q, block_k) -> None:
    visits = _Visits(monkeypatch)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 40, 4)) for _ in range(3))
    problem = flash.Problem(0.5, True, rows[0], block_q, block_k)
    flash.forward(np, q[:, :, rows[0] : rows[1]], k, v, None, problem)
    assert visits.pairs == LoopNest.causal_pairs(rows, (0, 40), block_q)
    visits.pairs = 0
    grad = rng.standard_normal((1, 2, rows[1] - rows[0], 4))
    part = q[:, :, rows[0] : rows[1]]
    out, lse = flash.forward_with_lse(np, part, k, v, None, problem)
    visits.pairs = 0
    flash.backward(np, part, k, v, None, out, grad, problem, lse=lse)
    assert visits.pairs == LoopNest.causal_pairs(rows, (0, 40), block_q)  # the same tiles


def _attention(path: Path, b: int, h: int, m: int, e: int, causal: int, mask=None) -> Path:
    shapes = {"q": [b, h, m, e], "k": [b, h, m, e], "v": [b, h, m, e]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()]
    names, initializers = ["q", "k", "v"], []
    if mask is not None:
        initializers.append(numpy_helper.from_array(mask, "mask"))
        names.append("mask")
    node = helper.make_node("Attention", names, ["y"], name="att", is_causal=causal)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, h, m, e])
    graph = helper.make_graph([node], "g", inputs, [out], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)
    return path


def _op(path: Path):
    graph = load_model(path).graph
    return next(op for op in graph.ops if op.type == "Attention")


def test_a_causal_attention_task_counts_the_pairs_its_kernel_computes(
    tmp_path: Path, monkeypatch
) -> None:
    b, h, m, e = 1, 4, 1000, 8
    op = _op(_attention(tmp_path / "causal.onnx", b, h, m, e, 1))
    nest = op.nest
    assert nest.causal == (nest.dim_index("m"), nest.dim_index("k"), flash.CAUSAL_BLOCK_Q)
    # no longer halved: the count does that
    assert nest.flops_per_point == round((2 * e + 2 * e + 5) / e)
    visits = _Visits(monkeypatch)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, h, m, e)) for _ in range(3))
    for lo, hi in ((0, 1000), (0, 250), (750, 1000), (300, 700)):
        visits.pairs = 0
        flash.forward(np, q[:, :, lo:hi], k, v, None, flash.Problem(0.5, True, lo))
        box = ((0, b), (0, h), (lo, hi), (0, e), (0, m))
        # a tile spans every head: its pairs times b, h and the value width
        assert nest.work_points(box) == visits.pairs * b * h * e
    # the whole op: half the square plus the diagonal's blocks (1000 = 7 x 128 + 104)
    pairs = sum(min(m, s + 128) * (min(m, s + 128) - s) for s in range(0, m, 128))
    assert nest.flops == b * h * e * pairs * nest.flops_per_point
    assert m * m / 2 < pairs < m * m / 2 + m * 128 / 2 + m
    # contiguous quarters of 250 rows: a block of 128 rows and one of 122 each, every
    # block over the keys up to its last row
    for c in range(4):
        box = ((0, b), (0, h), (250 * c, 250 * c + 250), (0, e), (0, m))
        by_hand = 128 * (250 * c + 128) + 122 * (250 * c + 250)
        assert nest.work_points(box) == b * h * e * by_hand


def test_a_mask_given_as_a_tensor_computes_every_tile(tmp_path: Path, monkeypatch) -> None:
    """A float mask that is not exactly the causal pattern stays a tensor: the kernel
    adds it to every tile, skipping none, and the count is the whole square."""
    b, h, m, e = 1, 2, 300, 4
    mask = np.where(np.tril(np.ones((m, m))) > 0, 0.0, -1e9).astype(np.float32)
    mask[5, 2] = -0.5  # not the causal pattern: the fusion keeps it a tensor
    op = _op(_attention(tmp_path / "mask.onnx", b, h, m, e, 0, mask))
    assert op.attrs.has_mask and not op.attrs.causal and op.nest.causal is None
    visits = _Visits(monkeypatch)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((b, h, m, e)) for _ in range(3))
    flash.forward(np, q, k, v, mask, flash.Problem(0.5, False))
    assert visits.pairs == m * m
    assert op.nest.flops == b * h * m * e * m * op.nest.flops_per_point


def test_the_cost_db_tells_causal_tasks_apart_by_where_they_lie(tmp_path: Path) -> None:
    """Four query quarters of a causal attention have one shape but not one cost: the
    cost DB's key (``costdb.cost_key``) holds their work; a mask-free, non-causal op's
    quarters share one key."""
    from onnx2soap.sim.costdb import cost_key
    from onnx2soap.soap import Partitioner, analyze
    from onnx2soap.soap.partition import ParallelConfig

    keys = {}
    for causal in (1, 0):
        path = _attention(tmp_path / f"a{causal}.onnx", 1, 2, 512, 8, causal)
        graph = load_model(path).graph
        op = next(op for op in graph.ops if op.type == "Attention")
        dims = analyze(graph)[op.name]
        degrees = tuple(4 if d.name == "m" else 1 for d in dims)
        tasks = Partitioner(graph).tasks(op, ParallelConfig(degrees, (0, 1, 2, 3)))
        keys[causal] = [cost_key(op, t) for t in tasks]
    assert len(set(keys[1])) == 4
    assert len(set(keys[0])) == 1
