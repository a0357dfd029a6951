"""ZeRO's shard math and ring halves (soap/zero.py, soap/collectives.py), checked against
numpy: the shards are numpy.array_split's row blocks and contiguous runs of the flat
buffer, a simulated reduce-scatter leaves every member the sum of its own run, the
all-gather gives everyone everything, and the two halves move an all-reduce's bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from onnx2soap.errors import PlanError
from onnx2soap.ir import LossKind
from onnx2soap.soap import OpPlan, Plan, load_plan, save_plan
from onnx2soap.soap.collectives import (
    all_gather_steps,
    chunks_bytes_sent,
    reduce_scatter_steps,
    ring_bytes_sent,
)
from onnx2soap.soap.partition import ReplicaGroup, rect_shape
from onnx2soap.soap.zero import Zero, ZeroStage, check_zero, row_shards, zero_group


def _group(rect, devices=(0, 1, 2), trainable=True) -> ReplicaGroup:
    return ReplicaGroup("w", 1, rect, tuple(range(len(devices))), devices, trainable)


@pytest.mark.parametrize(
    "rect", [((0, 10), (0, 3)), ((4, 11), (2, 5), (0, 2)), ((0, 3),), ((5, 9), (0, 1))]
)
@pytest.mark.parametrize("k", [2, 3, 4])
def test_shards_are_array_splits_row_blocks_and_flat_runs(rect, k) -> None:
    shape = rect_shape(rect)
    whole = np.arange(math.prod(shape)).reshape(shape)
    zg = zero_group(_group(rect, tuple(range(k))), ZeroStage.GRADIENTS)
    if shape[0] < k:
        assert zg is None and row_shards(rect, k) is None
        return
    blocks = np.array_split(whole, k, axis=0)
    flat = whole.reshape(-1)
    for i, (shard, (lo, hi), block) in enumerate(zip(zg.shards, zg.chunks, blocks, strict=True)):
        local = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(shard, rect, strict=True))
        np.testing.assert_array_equal(whole[local], block)
        np.testing.assert_array_equal(flat[lo:hi], block.reshape(-1))
        assert zg.numel(i) == block.size
        assert zg.rows(i) == (local[0].start, local[0].stop)
    assert zg.chunks[0][0] == 0 and zg.chunks[-1][1] == flat.size


def test_groups_zero_leaves_whole() -> None:
    rect = ((0, 8), (0, 2))
    assert zero_group(_group(rect), ZeroStage.NONE) is None
    assert zero_group(_group(rect, trainable=False), ZeroStage.OPTIMIZER) is None
    assert zero_group(_group(rect, (3,)), ZeroStage.OPTIMIZER) is None
    assert zero_group(_group(rect, (1, 5)), ZeroStage.OPTIMIZER).shard(5) == ((4, 8), (0, 2))


@pytest.mark.parametrize("k", [2, 3, 5])
def test_reduce_scatter_then_all_gather_is_an_all_reduce(k: int) -> None:
    """Run the members' steps in lock step on numpy copies, uneven runs included."""
    rng = np.random.default_rng(k)
    rect = ((0, 2 * k + 1), (0, 3))
    zg = zero_group(_group(rect, tuple(range(k))), ZeroStage.GRADIENTS)
    data = [rng.standard_normal(rect_shape(rect)).reshape(-1) for _ in range(k)]
    total = np.sum(data, axis=0)
    bufs = [d.copy() for d in data]
    for steps in (reduce_scatter_steps, None, all_gather_steps):
        if steps is None:  # between the halves: each member holds the sum of its run
            for r in range(k):
                lo, hi = zg.chunks[r]
                np.testing.assert_allclose(bufs[r][lo:hi], total[lo:hi], rtol=1e-13)
            continue
        schedule = [steps(r, k) for r in range(k)]
        for s in range(k - 1):
            sent = []
            for r in range(k):  # every member sends to its right at once
                lo, hi = zg.chunks[schedule[r][s].send_chunk]
                sent.append(bufs[r][lo:hi].copy())
            for r in range(k):
                step = schedule[r][s]
                assert step.recv_chunk == schedule[(r - 1) % k][s].send_chunk
                lo, hi = zg.chunks[step.recv_chunk]
                incoming = sent[(r - 1) % k]
                bufs[r][lo:hi] = bufs[r][lo:hi] + incoming if step.reduce else incoming
    for r in range(k):
        np.testing.assert_array_equal(bufs[r], bufs[0])  # every copy bit-identical
    np.testing.assert_allclose(bufs[0], total, rtol=1e-13)
    # What the two halves send together, summed over members, is the all-reduce's.
    halves = sum(
        chunks_bytes_sent(zg.chunks, steps(r, k), 8)
        for r in range(k)
        for steps in (reduce_scatter_steps, all_gather_steps)
    )
    numel = math.prod(rect_shape(rect))
    assert halves == sum(ring_bytes_sent(numel, k, r, 8) for r in range(k))
    assert halves == 2 * (k - 1) * numel * 8


def _plan(tmp_path: Path, stage: ZeroStage) -> Path:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"x")
    plan = Plan(
        model, "0" * 64, 4, LossKind.MODEL, 2, (OpPlan("a", (("n", 2),), (0, 1)),),
        zero_stage=stage,
    )  # fmt: skip
    path = tmp_path / "p.json"
    save_plan(plan, path)
    return path


@pytest.mark.parametrize("stage", list(ZeroStage))
def test_the_plan_file_carries_the_stage(tmp_path: Path, stage: ZeroStage) -> None:
    path = _plan(tmp_path, stage)
    doc = json.loads(path.read_text())
    assert doc.get("zero_stage") == (int(stage) if stage else None)  # absent without ZeRO
    assert load_plan(path).zero_stage is stage


@pytest.mark.parametrize("bad", [0, 4, -1, "2", True, 1.5, [2]])
def test_a_stage_other_than_1_2_or_3_is_named(tmp_path: Path, bad) -> None:
    path = _plan(tmp_path, ZeroStage.OPTIMIZER)
    doc = json.loads(path.read_text())
    doc["zero_stage"] = bad
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"field 'zero_stage'") as e:
        load_plan(path)
    assert "\n" not in str(e.value)


def test_zero_without_data_parallelism_is_refused() -> None:
    whole = [_group(((0, 8),), (0,)), _group(((0, 8),), (1,))]
    with pytest.raises(PlanError, match=r"p.json: field 'zero_stage': 2 needs data parallel"):
        check_zero(ZeroStage.GRADIENTS, whole, "p.json")
    check_zero(ZeroStage.NONE, whole, "p.json")
    check_zero(ZeroStage.OPTIMIZER, [*whole, _group(((0, 1),), (0, 1))], "p.json")


def test_the_plan_file_carries_stages_by_weight(tmp_path: Path) -> None:
    """``zero_stages`` names weights at another stage than ``zero_stage`` (written only
    where some are); the plan's ``Zero`` gives every weight its stage."""
    path = _plan(tmp_path, ZeroStage.GRADIENTS)
    doc = json.loads(path.read_text())
    assert "zero_stages" not in doc
    doc["zero_stages"] = {"w2": 3, "w1": 0}
    path.write_text(json.dumps(doc))
    loaded = load_plan(path)
    assert loaded.zero_weights == (("w1", ZeroStage.NONE), ("w2", ZeroStage.PARAMETERS))
    zero = loaded.zero
    assert [zero.weight(w) for w in ("w1", "w2", "w3")] == [0, 3, 2]
    assert zero.top is ZeroStage.PARAMETERS and zero.shards_weights
    assert zero.label == "ZeRO-2, 1 weights none, 1 weights ZeRO-3"
    save_plan(loaded, path)
    assert json.loads(path.read_text())["zero_stages"] == {"w1": 0, "w2": 3}


@pytest.mark.parametrize("bad", [4, -1, "2", True, 1.5, None, [3]])
def test_a_bad_stage_by_weight_is_named(tmp_path: Path, bad) -> None:
    path = _plan(tmp_path, ZeroStage.OPTIMIZER)
    doc = json.loads(path.read_text())
    doc["zero_stages"] = {"fc.weight": bad}
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"field 'zero_stages.fc.weight'") as e:
        load_plan(path)
    assert "\n" not in str(e.value)


def test_stages_by_weight_alone_need_data_parallelism() -> None:
    """A plan at no stage but with weights at one is ZeRO all the same."""
    whole = [_group(((0, 8),), (0,)), _group(((0, 8),), (1,))]
    zero = Zero(ZeroStage.NONE, (("w", ZeroStage.PARAMETERS),))
    with pytest.raises(PlanError, match=r"field 'zero_stage': 3 needs data parallel"):
        check_zero(zero, whole, "p.json")
    group = _group(((0, 4),), (0, 1))
    assert zero_group(group, zero) is not None  # _group's weight is "w"
    assert zero_group(group, Zero(ZeroStage.PARAMETERS, (("w", ZeroStage.NONE),))) is None
    with pytest.raises(ValueError, match="sorted"):
        Zero(ZeroStage.NONE, (("b", ZeroStage.NONE), ("a", ZeroStage.NONE)))
    with pytest.raises(ValueError, match="once"):
        Zero(ZeroStage.NONE, (("a", ZeroStage.NONE), ("a", ZeroStage.PARAMETERS)))
