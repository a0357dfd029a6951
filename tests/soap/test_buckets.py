"""Gradient buckets (soap/buckets.py): which ops' gradients are summed together, by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.soap.buckets import (
    MIB,
    BucketRing,
    Buckets,
    BucketScatter,
    all_rings,
    all_scatters,
    bucket_rings,
    bucket_scatters,
    check_bucket_mb,
    gradient_buckets,
    shard_major,
    weight_bytes,
)
from onnx2soap.soap.partition import ReplicaGroup
from onnx2soap.soap.zero import ZeroStage


def three_gemms(path: Path) -> Path:
    """x [B, 8] -> Gemm(W1 [8, 16], b1) -> Relu -> Gemm(W2 [16, 16], b2) -> Relu ->
    Gemm(W3 [16, 4], b3): 576, 1,088 and 272 bytes of float32 weights."""
    shapes = {"W1": (8, 16), "b1": (16,), "W2": (16, 16), "b2": (16,), "W3": (16, 4), "b3": (4,)}
    weights = [numpy_helper.from_array(np.ones(s, np.float32), n) for n, s in shapes.items()]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h1"], name="gemm1"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
        helper.make_node("Gemm", ["r1", "W2", "b2"], ["h2"], name="gemm2"),
        helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
        helper.make_node("Gemm", ["r2", "W3", "b3"], ["logits"], name="gemm3"),
    ]
    graph = helper.make_graph(
        nodes,
        "three",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 4])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return load_model(three_gemms(tmp_path_factory.mktemp("gemms") / "m.onnx"), batch=4).graph


def _index(graph, *names: str) -> tuple[int, ...]:
    at = {op.name: i for i, op in enumerate(graph.ops)}
    return tuple(at[n] for n in names)


def test_weight_bytes_are_the_ops_whole_weights(graph) -> None:
    sizes = {op.name: weight_bytes(graph, i) for i, op in enumerate(graph.ops)}
    assert {n: b for n, b in sizes.items() if b} == {"gemm1": 576, "gemm2": 1088, "gemm3": 272}


@pytest.mark.parametrize(
    ("cap_bytes", "buckets"),
    [
        # gemm3's 272 bytes do not fill 1,100, with gemm2's 1,360 do: the bucket closes,
        # and gemm1 is the last one, not full
        (1100, [("gemm3", "gemm2"), ("gemm1",)]),
        (1360, [("gemm3", "gemm2"), ("gemm1",)]),  # reaching the size closes it
        (1361, [("gemm3", "gemm2", "gemm1")]),
        (272, [("gemm3",), ("gemm2",), ("gemm1",)]),  # every op fills one
        (25 * MIB, [("gemm3", "gemm2", "gemm1")]),
    ],
)
def test_buckets_fill_in_backward_order(graph, cap_bytes: int, buckets) -> None:
    got = gradient_buckets(graph, cap_bytes / MIB)
    assert got.ops == tuple(_index(graph, *b) for b in buckets)
    assert got.unsummed == frozenset()  # every op's output takes a gradient
    assert got.bucket_of() == {i: b for b, ops in enumerate(got.ops) for i in ops}


def test_the_example_cnns_buckets(example_onnx: Path) -> None:
    """fc2's 2,600 bytes fill a 2 KiB bucket, fc1's 524,544 the next; branch_b's
    convolution (1,088) and branch_a's (9,280) share one; conv1 (1,792) is the last."""
    graph = load_model(example_onnx, batch=4).graph
    names = [("/fc2/Gemm",), ("/fc1/Gemm",), ("/branch_b/conv/Conv", "/branch_a/conv/Conv")]
    names.append(("/conv1/Conv",))
    assert gradient_buckets(graph, 2 / 1024).ops == tuple(_index(graph, *b) for b in names)


def _group(weight: str, rows: tuple[int, int], devices, trainable: bool = True) -> ReplicaGroup:
    tasks = tuple(range(len(devices)))
    return ReplicaGroup(weight, 1, (rows, (0, 4)), tasks, tuple(devices), trainable)


GROUPS = {
    # op 5: two halves of a weight's rows, over (0, 1) and (2, 3), and its bias, whole
    5: (_group("w5", (0, 2), (0, 1)), _group("w5", (2, 4), (2, 3)), _group("b5", (0, 1), (0, 1))),
    # op 3: its weight on one device (no sum) and a state tensor (no gradient)
    3: (_group("w3", (0, 8), (1,)), _group("s3", (0, 8), (0, 1), trainable=False)),
    # op 1: over (0, 1) again, its 8 rows a chunk for ZeRO's two members
    1: (_group("w1", (0, 8), (0, 1)),),
}


def test_a_bucket_sums_each_device_set_in_one_ring() -> None:
    rings = bucket_rings(2, (5, 3, 1), GROUPS.__getitem__)
    assert rings == (
        BucketRing(2, (0, 1), ((5, 0), (5, 2), (1, 0)), 8 + 4 + 32),
        BucketRing(2, (2, 3), ((5, 1),), 8),
    )
    assert [r.closing for r in rings] == [1, 5]  # after their last gradient is made
    assert rings[0].name == "allreduce bucket 2 on 0,1"


def test_zero_reduce_scatters_what_it_shards_outside_the_buckets() -> None:
    """ZeRO shards the groups with at least as many rows as members: w1 (8 rows) and
    w5's halves (2 rows each); the bias (1 row) stays whole and in the bucket's ring."""
    rings = bucket_rings(0, (5, 3, 1), GROUPS.__getitem__, ZeroStage.GRADIENTS)
    assert rings == (BucketRing(0, (0, 1), ((5, 2),), 4),)


def test_zero_reduce_scatters_a_buckets_shards_together() -> None:
    """The groups ZeRO shards in the bucket, per device set: w5's first half and w1 over
    (0, 1), w5's second half over (2, 3). A group's rows split in two runs of its flat
    buffer (4 elements a row): w5's half [0, 4) and [4, 8), w1's [0, 16) and [16, 32).
    Laid out shard-major, member 0 owns w5's first run then w1's: one run [0, 20)."""
    scatters = bucket_scatters(0, (5, 3, 1), GROUPS.__getitem__, ZeroStage.GRADIENTS)
    assert scatters == (
        BucketScatter(0, (0, 1), ((5, 0), (1, 0)), (((0, 4), (4, 8)), ((0, 16), (16, 32)))),
        BucketScatter(0, (2, 3), ((5, 1),), (((0, 4), (4, 8)),)),
    )
    first = scatters[0]
    assert first.closing == 1 and first.numel == 40
    assert first.chunks() == ((0, 20), (20, 40))
    assert first.name == "reduce-scatter bucket 0 on 0,1"
    pieces, chunks = shard_major(first.runs)
    assert pieces == ((0, (0, 4)), (1, (0, 16)), (0, (4, 8)), (1, (16, 32)))
    assert chunks == first.chunks()
    # without ZeRO nothing is reduce-scattered
    assert bucket_scatters(0, (5, 3, 1), GROUPS.__getitem__, ZeroStage.NONE) == ()
    by_op = all_scatters(Buckets(((5, 3), (1,))), GROUPS.__getitem__, ZeroStage.OPTIMIZER)
    assert {i: [(x.bucket, x.devices) for x in xs] for i, xs in by_op.items()} == {
        5: [(0, (0, 1)), (0, (2, 3))],
        1: [(1, (0, 1))],
    }


def test_rings_by_the_op_they_start_after() -> None:
    by_op = all_rings(Buckets(((5, 3), (1,))), GROUPS.__getitem__)
    assert {i: [(r.bucket, r.devices) for r in rs] for i, rs in by_op.items()} == {
        5: [(0, (0, 1)), (0, (2, 3))],
        1: [(1, (0, 1))],
    }


def test_an_op_whose_output_takes_no_gradient_is_summed_by_no_ring() -> None:
    """Its weights' gradients stay zero (the executor runs no backward for it): were it
    a ring's last member, the ring would start after a backward that never runs."""
    buckets = Buckets(((5, 3), (1,)), unsummed=frozenset({5}))
    assert buckets.summed(0) == (3,)
    by_op = all_rings(buckets, GROUPS.__getitem__)
    assert {i: [(r.bucket, r.devices) for r in rs] for i, rs in by_op.items()} == {1: [(1, (0, 1))]}


@pytest.mark.parametrize("value", [0, -1, 0.0, float("nan"), float("inf"), True, "25", None])
def test_a_bucket_size_is_a_finite_number_above_zero(value) -> None:
    with pytest.raises(ValueError, match="MiB"):
        check_bucket_mb(value)
    assert check_bucket_mb(25) == 25.0 and check_bucket_mb(0.001) == 0.001


def test_the_first_bucket_closes_at_one_mib(tmp_path: Path) -> None:
    """DDP's first bucket holds 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``), the rest
    ``bucket_mb``: Gemms of 512 KiB of weights each (a [256, 512] float32 kernel, no
    bias) cut into 2, then 3 and 3 at 1.5 MiB; a bucket size under 1 MiB holds for the
    first too."""
    shapes = [(256, 512), (512, 256)] * 4
    weights = [
        numpy_helper.from_array(np.ones(s, np.float32), f"W{i}") for i, s in enumerate(shapes)
    ]
    names, x = [], "x"
    nodes = []
    for i in range(len(shapes)):
        nodes.append(helper.make_node("MatMul", [x, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
        names.append(f"mm{i}")
        x = f"h{i}"
    graph_proto = helper.make_graph(
        nodes,
        "mms",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, ["batch", 256])],
        weights,
    )
    path = tmp_path / "mms.onnx"
    model = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    graph = load_model(path, batch=4).graph
    assert all(weight_bytes(graph, i) == 512 * 1024 for i in _index(graph, *names))
    backward = names[::-1]
    want = [backward[:2], backward[2:5], backward[5:]]
    assert gradient_buckets(graph, 1.5).ops == tuple(_index(graph, *b) for b in want)
    half = [backward[i : i + 1] for i in range(8)]
    assert gradient_buckets(graph, 0.5).ops == tuple(_index(graph, *b) for b in half)
