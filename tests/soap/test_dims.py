"""SOAP dim kinds and splittability from the loop nests (soap.dims.analyze)."""

from __future__ import annotations

from onnx2soap.ir import LossKind, TensorRole
from onnx2soap.soap.dims import DimKind, SoapDim, analyze
from tests.soap.builders import (
    Window,
    ce_loss_op,
    conv_op,
    elementwise_op,
    flatten_op,
    gemm_op,
    make_graph,
    mse_loss_op,
    pool_op,
    small_cnn,
    tensor,
    transpose_op,
)

S, A, P, R = DimKind.SAMPLE, DimKind.ATTRIBUTE, DimKind.PARAMETER, DimKind.REDUCTION
Row = tuple[str, int, DimKind, int | None, bool]


def rows(dims: tuple[SoapDim, ...]) -> list[Row]:
    return [(d.name, d.size, d.kind, d.axis, d.splittable) for d in dims]


def test_small_cnn_dims() -> None:
    space = analyze(small_cnn())
    assert list(space) == ["conv", "pool", "concat", "relu", "flatten", "gemm", "loss_op"]
    assert rows(space["conv"]) == [
        ("n", 4, S, 0, True),
        ("co", 4, P, 1, True),  # indexes W's axis 0 (and b)
        ("l", 10, A, 2, True),  # a window map, not the batch
        ("ci", 3, R, None, False),
        ("kl", 3, R, None, False),
    ]
    assert rows(space["pool"]) == [
        ("n", 4, S, 0, True),
        ("c", 3, A, 1, True),
        ("l", 10, A, 2, True),
        ("kl", 3, R, None, False),
    ]
    # Concat reads its inputs through offset maps: still one-to-one, so n stays sample
    assert rows(space["concat"]) == [
        ("n", 4, S, 0, True),
        ("c", 7, A, 1, True),
        ("l", 10, A, 2, True),
    ]
    assert rows(space["relu"]) == [
        ("n", 4, S, 0, True),
        ("c", 7, A, 1, True),
        ("l", 10, A, 2, True),
    ]
    # the merged axis is hidden in Whole(dims=(1,)): kept, but never split
    assert rows(space["flatten"]) == [("n", 4, S, 0, True), ("r1", 70, A, 1, False)]
    assert rows(space["gemm"]) == [
        ("n", 4, S, 0, True),
        ("co", 5, P, 1, True),
        ("ci", 70, R, None, False),
    ]
    # the loss's sample dim is absent from its scalar output, yet sample and splittable
    assert rows(space["loss_op"]) == [("n", 4, S, None, True), ("c", 5, R, None, False)]


def test_sample_follows_a_transposed_batch_axis() -> None:
    R_ = TensorRole
    tensors = [
        tensor("x", (4, 6), R_.INPUT),
        tensor("t", (6, 4)),
        tensor("u", (6, 4)),
        tensor("loss", ()),
        tensor("target", (6, 4)),
    ]
    ops = [
        transpose_op("tr", "x", "t", 4, 6),  # t[c, n] = x[n, c]
        elementwise_op("relu", ["t"], "u", (6, 4)),
        mse_loss_op("mse", "u", "target", "loss", (6, 4)),
    ]
    space = analyze(make_graph(tensors, ops, labels=None, loss=LossKind.MSE))
    assert rows(space["tr"]) == [("n", 4, S, 1, True), ("c", 6, A, 0, True)]
    # the batch is now axis 1 of t: relu's dim over axis 1 is the sample dim
    assert rows(space["relu"]) == [("n", 6, A, 0, True), ("c", 4, S, 1, True)]
    # the loss reduces both dims; each splits as the batch does (its targets index both:
    # every task's squared errors are a partial sum of the whole batch's)
    assert rows(space["mse"]) == [("n", 6, S, None, True), ("c", 4, S, None, True)]


def test_labels_make_the_loss_dim_sample() -> None:
    """Scores whose batch was lost (read Whole) still give a sample loss dim via labels."""
    from onnx2soap.ir import IterDim, LoopNest, Op, Operand, Whole, identity
    from onnx2soap.ops.base import NoAttrs

    mix = Op(
        "mix",
        "Identity",
        ("x",),
        "m",
        NoAttrs(),
        LoopNest(
            (IterDim("n", 4), IterDim("c", 3)),
            (Operand("x", (Whole(dims=(0,)), identity(1))),),
            (0, 1),
        ),
    )
    tensors = [
        tensor("x", (4, 3), TensorRole.INPUT),
        tensor("m", (4, 3)),
        tensor("labels", (4,), TensorRole.LABELS),
        tensor("loss", ()),
    ]
    graph = make_graph(tensors, [mix, ce_loss_op("ce", "m", "labels", "loss", 4, 3)])
    space = analyze(graph)
    assert rows(space["mix"]) == [("n", 4, A, 0, False), ("c", 3, A, 1, True)]
    assert rows(space["ce"]) == [("n", 4, S, None, True), ("c", 3, R, None, False)]


def test_parameter_needs_a_kept_dim_and_a_weight() -> None:
    R_ = TensorRole
    tensors = [
        tensor("x", (2, 3), R_.INPUT),
        tensor("a", (3, 5)),  # an activation read like a weight: no parameter dim
        tensor("w", (3, 5), R_.WEIGHT),
        tensor("y", (2, 5)),
        tensor("z", (2, 5)),
    ]
    ops = [
        gemm_op("g_act", "x", "a", None, "y", 2, 3, 5),
        gemm_op("g_w", "x", "w", None, "z", 2, 3, 5),
    ]
    space = analyze(make_graph(tensors, ops, labels=None, loss=LossKind.NONE))
    assert [d.kind for d in space["g_act"]] == [S, A, R]
    assert [d.kind for d in space["g_w"]] == [S, P, R]  # ci indexes w too, but reduces


def test_size_one_and_window_dims() -> None:
    win = Window(5, 2, stride=2, ceil_mode=True)
    tensors = [
        tensor("x", (1, 1, 5), TensorRole.INPUT),
        tensor("w", (1, 1, 2), TensorRole.WEIGHT),
        tensor("y", (1, 1, 3)),
        tensor("p", (1, 1, 3)),
    ]
    ops = [
        conv_op("c", "x", "w", None, "y", 1, 1, 1, [win]),
        pool_op("p", "y", "p", 1, 1, [Window(3, 1)]),
    ]
    space = analyze(make_graph(tensors, ops, labels=None, loss=LossKind.NONE))
    # size-1 dims are never splittable, whatever their kind
    assert rows(space["c"]) == [
        ("n", 1, S, 0, False),
        ("co", 1, P, 1, False),
        ("l", 3, A, 2, True),
        ("ci", 1, R, None, False),
        ("kl", 2, R, None, False),
    ]
    assert [d.kind for d in space["p"]] == [S, A, A, R]


def test_flatten_hidden_dims_and_sample_chain() -> None:
    tensors = [
        tensor("x", (3, 2, 4), TensorRole.INPUT),
        tensor("f", (3, 8)),
        tensor("g", (3, 8)),
    ]
    ops = [flatten_op("fl", "x", (3, 2, 4), "f"), elementwise_op("e", ["f"], "g", (3, 8))]
    space = analyze(make_graph(tensors, ops, labels=None, loss=LossKind.NONE))
    assert rows(space["fl"]) == [("n", 3, S, 0, True), ("r1", 8, A, 1, False)]
    assert rows(space["e"]) == [("n", 3, S, 0, True), ("c", 8, A, 1, True)]
