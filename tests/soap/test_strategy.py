"""Strategy validation: every wrong field gives a PlanError naming the op and the field."""

from __future__ import annotations

import re

import pytest

from onnx2soap.errors import PlanError
from onnx2soap.soap.dims import analyze
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.strategy import Strategy, validate
from tests.soap.builders import small_cnn

GRAPH = small_cnn()
SPACE = analyze(GRAPH)
DEVICES = 4


def base() -> Strategy:
    """Every op on device 0, unsplit."""
    return Strategy(
        DEVICES, {op.name: ParallelConfig((1,) * len(SPACE[op.name]), (0,)) for op in GRAPH.ops}
    )


def test_the_base_strategy_validates() -> None:
    validate(GRAPH, SPACE, base())
    # data parallel everywhere also validates
    dp = {
        name: ParallelConfig((4, *(1,) * (len(dims) - 1)), (0, 1, 2, 3))
        for name, dims in SPACE.items()
    }
    validate(GRAPH, SPACE, Strategy(DEVICES, dp))


# (op, config, words that the message must contain besides the op's name)
BAD = [
    ("relu", ParallelConfig((1, 1, 1, 1), (0,)), ["4 degrees", "3 dims"]),
    ("relu", ParallelConfig((1, 1), (0,)), ["2 degrees", "3 dims"]),
    ("gemm", ParallelConfig((1, 1, 2), (0, 1)), ["degrees.ci", "cannot be split"]),
    ("flatten", ParallelConfig((1, 2), (0, 1)), ["degrees.r1", "cannot be split"]),
    ("loss_op", ParallelConfig((1, 2), (0, 1)), ["degrees.c"]),
    ("conv", ParallelConfig((5, 1, 1, 1, 1), (0, 1, 2, 3, 0)), ["degrees.n", "size 4"]),
    ("relu", ParallelConfig((1, 1, 11), tuple(range(11))), ["degrees.l", "size 10"]),
    ("relu", ParallelConfig((0, 1, 1), ()), ["degrees.n", ">= 1"]),
    ("relu", ParallelConfig((2, 1, 1), (0,)), ["devices", "2 tasks"]),
    ("relu", ParallelConfig((2, 2, 1), (0, 1, 2)), ["devices", "4 tasks"]),
    ("relu", ParallelConfig((2, 1, 1), (0, 4)), ["device 4", "0..3"]),
    ("relu", ParallelConfig((2, 1, 1), (-1, 0)), ["device -1"]),
]


@pytest.mark.parametrize(("op", "config", "words"), BAD)
def test_wrong_config_names_op_and_field(op: str, config: ParallelConfig, words: list[str]):
    strategy = base().replace(op, config)
    with pytest.raises(PlanError) as info:
        validate(GRAPH, SPACE, strategy)
    message = str(info.value)
    assert f"'{op}'" in message
    for word in words:
        assert word in message, message


def test_missing_op_is_named() -> None:
    configs = dict(base().configs)
    del configs["pool"]
    with pytest.raises(PlanError, match=r"missing.*'pool'"):
        validate(GRAPH, SPACE, Strategy(DEVICES, configs))


def test_unknown_op_is_named() -> None:
    strategy = base().replace("bogus", ParallelConfig((1,), (0,)))
    with pytest.raises(PlanError, match=r"does not have.*'bogus'"):
        validate(GRAPH, SPACE, strategy)


def test_device_count_must_be_positive() -> None:
    with pytest.raises(PlanError, match=re.escape("devices must be >= 1, got 0")):
        validate(GRAPH, SPACE, Strategy(0, dict(base().configs)))


def test_strategy_equality_and_hash() -> None:
    a, b = base(), base()
    assert a == b and hash(a) == hash(b)
    c = a.replace("relu", ParallelConfig((2, 1, 1), (0, 1)))
    assert c != a
    assert a["relu"] == ParallelConfig((1, 1, 1), (0,))  # replace does not mutate
    with pytest.raises(TypeError):
        a.configs["relu"] = c["relu"]  # type: ignore[index]
