"""Copies of a weight-only op (``ParallelConfig.copies``): tasks box-major, one owner a
box, each reader's piece from the copy on its own device else from the owner, one
replica group over the copies; the strategy, the plan file and the ONNX annotations
take them only where sound, and a bad value is one line, exit 2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import onnx
import pytest

from onnx2soap.cli import main as cli
from onnx2soap.errors import PlanError
from onnx2soap.importer import load_model
from onnx2soap.ir import TensorRole
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import analyze
from onnx2soap.soap.annotations import read_annotated
from onnx2soap.soap.annotations.metadata import drop_ours
from onnx2soap.soap.candidates import candidates, copied_devices
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.partition import (
    ParallelConfig,
    copy_groups,
    op_tasks,
    owners,
    replica_groups,
    sum_groups,
    summed_overlaps,
)
from onnx2soap.soap.plan import load_plan
from onnx2soap.soap.strategy import Strategy, validate
from tests.soap.builders import ce_loss_op, gemm_op, make_graph, tensor, transpose_op
from tests.weight_only_models import CHAIN, weight_chain_model

# W [6, 4] (weight) -> transpose "t" -> WT [4, 6] -> gemm "g": x [8, 4] @ WT -> [8, 6] -> loss
T = transpose_op("t", "W", "WT", 6, 4)
G = gemm_op("g", "x", "WT", None, "y", 8, 4, 6)
LOSS = ce_loss_op("loss", "y", "labels", "l", 8, 6)
GRAPH = make_graph(
    [
        tensor("x", (8, 4), TensorRole.INPUT),
        tensor("W", (6, 4), TensorRole.WEIGHT),
        tensor("WT", (4, 6)),
        tensor("y", (8, 6)),
        tensor("labels", (8,), TensorRole.LABELS),
        tensor("l", ()),
    ],
    [T, G, LOSS],
)
W_SHAPE, WT_SHAPE = [(6, 4)], [(8, 4), (4, 6)]


def tasks_t(degrees, devices, copies):
    return op_tasks(T, ParallelConfig(degrees, devices, copies), W_SHAPE)


def tasks_g(n: int, devices):
    return op_tasks(G, ParallelConfig((n, 1, 1), devices), WT_SHAPE)


def pieces(producers, consumers) -> list[tuple[int, int, tuple]]:
    """(consumer task, producer task, rect) of every overlap, by consumer."""
    found = summed_overlaps(T, producers, consumers, 1)
    return sorted((o.dst_task, o.src_task, o.rect) for o in found)


def test_tasks_are_box_major_with_one_owner_a_box() -> None:
    tasks = tasks_t((1, 1), (2, 0, 1), 3)
    assert [(t.index, t.device, t.box) for t in tasks] == [
        (0, 2, ((0, 6), (0, 4))),
        (1, 0, ((0, 6), (0, 4))),
        (2, 1, ((0, 6), (0, 4))),
    ]
    assert [t.index for t in owners(T, tasks)] == [0]
    assert copy_groups(tasks) == {0: {2: 0, 0: 1, 1: 2}}
    # split rows in 2, two copies a box: box 0 on devices 0 and 2, box 1 on 1 and 3
    split = tasks_t((2, 1), copied_devices(0, 2, 2), 2)
    assert [(t.index, t.device, t.output) for t in split] == [
        (0, 0, ((0, 4), (0, 3))),
        (1, 2, ((0, 4), (0, 3))),
        (2, 1, ((0, 4), (3, 6))),
        (3, 3, ((0, 4), (3, 6))),
    ]
    assert [t.index for t in owners(T, split)] == [0, 2]
    assert copy_groups(tasks_t((2, 1), (0, 1), 1)) == {}


def test_a_reader_takes_its_own_devices_copy() -> None:
    whole = ((0, 4), (0, 6))
    assert pieces(tasks_t((1, 1), (0, 1, 2), 3), tasks_g(3, (0, 1, 2))) == [
        (0, 0, whole),
        (1, 1, whole),
        (2, 2, whole),
    ]
    # the devices in another order: still the local copy
    assert pieces(tasks_t((1, 1), (2, 0, 1), 3), tasks_g(3, (0, 1, 2))) == [
        (0, 1, whole),
        (1, 2, whole),
        (2, 0, whole),
    ]


def test_a_reader_without_a_copy_takes_the_owners() -> None:
    # copies on devices 1 and 2 (task 0 on 1 owns the box); readers on 0, 1, 2
    whole = ((0, 4), (0, 6))
    assert pieces(tasks_t((1, 1), (1, 2), 2), tasks_g(3, (0, 1, 2))) == [
        (0, 0, whole),
        (1, 0, whole),
        (2, 1, whole),
    ]


def test_split_boxes_with_copies_each_from_local_else_owner() -> None:
    left, right = ((0, 4), (0, 3)), ((0, 4), (3, 6))
    split = tasks_t((2, 1), copied_devices(0, 2, 2), 2)  # box 0: 0, 2; box 1: 1, 3
    assert pieces(split, tasks_g(4, (0, 1, 2, 3))) == [
        (0, 0, left),  # device 0: box 0 here, box 1 from its owner on device 1
        (0, 2, right),
        (1, 0, left),  # device 1: box 0 from its owner on 0, box 1 here
        (1, 2, right),
        (2, 1, left),  # device 2: box 0 here (copy 1), box 1 from the owner
        (2, 2, right),
        (3, 0, left),
        (3, 3, right),  # device 3: box 1 here (copy 1)
    ]


def test_the_copies_are_one_replica_group_of_the_weight() -> None:
    (group,) = replica_groups(T, tasks_t((1, 1), (2, 0, 1), 3), [0])
    assert (group.weight, group.rect, group.tasks, group.devices) == (
        "W",
        ((0, 6), (0, 4)),
        (0, 1, 2),
        (0, 1, 2),
    )
    groups = replica_groups(T, tasks_t((2, 1), copied_devices(0, 2, 2), 2), [0])
    assert [(g.rect, g.devices) for g in groups] == [
        (((0, 3), (0, 4)), (0, 2)),
        (((3, 6), (0, 4)), (1, 3)),
    ]


def test_copies_are_not_partial_sums() -> None:
    assert sum_groups(T, tasks_t((1, 1), (0, 1), 2)) == ()  # no partial dims at all
    gemm = op_tasks(G, ParallelConfig((1, 1, 1), (0, 1), 2), WT_SHAPE)
    assert sum_groups(G, gemm) == ()  # whole tiles, copied
    partial = replace(G, nest=replace(G.nest, partial_dims=(2,)))  # ci: partial sums
    with pytest.raises(ValueError, match="copies of partial sums"):
        sum_groups(partial, op_tasks(partial, ParallelConfig((1, 1, 2), (0, 1, 2, 3), 2), WT_SHAPE))
    (group,) = sum_groups(partial, op_tasks(partial, ParallelConfig((1, 1, 2), (0, 1)), WT_SHAPE))
    assert group.tasks == (0, 1)


def test_weight_only_ops_are_those_fed_by_weights_alone() -> None:
    assert weight_only_ops(GRAPH) == {"t"}


def _strategy(t: ParallelConfig, g: ParallelConfig | None = None) -> Strategy:
    g = g or ParallelConfig((4, 1, 1), (0, 1, 2, 3))
    return Strategy(4, {"t": t, "g": g, "loss": ParallelConfig((4, 1), (0, 1, 2, 3))})


@pytest.mark.parametrize(
    ("t", "g", "words"),
    [
        (ParallelConfig((1, 1), (0, 1, 2), 2), None, "3 entries; the degrees and 2 copies"),
        (ParallelConfig((1, 1), (0, 0), 2), None, "distinct devices"),
        (ParallelConfig((1, 1), (), 0), None, "copies must be an integer >= 1, got 0"),
        (ParallelConfig((1, 1), (0,), -1), None, "copies must be an integer >= 1"),
        (ParallelConfig((1, 1), (0, 1), 2.0), None, "copies must be an integer >= 1"),
        (
            ParallelConfig((1, 1), (0,)),
            ParallelConfig((1, 1, 1), (0, 1), 2),
            "op 'g': copies = 2, but only an op that reads weights",
        ),
    ],
)
def test_the_strategy_refuses_bad_copies(t, g, words: str) -> None:
    with pytest.raises(PlanError) as info:
        validate(GRAPH, analyze(GRAPH), _strategy(t, g))
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_the_strategy_takes_copies_of_a_weight_only_op() -> None:
    validate(GRAPH, analyze(GRAPH), _strategy(ParallelConfig((1, 1), (3, 1, 0, 2), 4)))
    validate(GRAPH, analyze(GRAPH), _strategy(ParallelConfig((2, 1), (0, 2, 1, 3), 2)))


def test_candidates_add_copies_for_a_weight_only_op() -> None:
    dims = analyze(GRAPH)["t"]
    plain, copied = candidates(dims, 4), candidates(dims, 4, copies=True)
    assert copied[: len(plain)] == plain and all(c.copies == 1 for c in plain)
    extra = copied[len(plain) :]
    assert ParallelConfig((1, 1), (0, 1, 2, 3), 4) in extra
    assert ParallelConfig((1, 1), (2, 3), 2) in extra
    assert ParallelConfig((2, 1), (0, 2, 1, 3), 2) in extra
    assert all(c.copies > 1 and c.tasks == c.boxes * c.copies for c in extra)


# --- the plan file and the CLI ------------------------------------------------------------


@pytest.fixture(scope="module")
def chain_plan(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("copies")
    model = weight_chain_model(folder / "chain.onnx")
    plan = folder / "dp.json"
    argv = ["plan", str(model), "--devices", "3", "--batch", "6", "--strategy", "data-parallel"]
    assert cli([*argv, "--search", "none", "-o", str(plan)]) == 0
    return plan


def test_data_parallel_copies_the_weight_chain(chain_plan: Path) -> None:
    doc = json.loads(chain_plan.read_text())
    by_name = {o["name"]: o for o in doc["ops"]}
    for name in CHAIN:
        assert by_name[name]["copies"] == 3 and by_name[name]["devices"] == [0, 1, 2]
        assert set(by_name[name]["degrees"].values()) <= {1}
    assert all("copies" not in o for n, o in by_name.items() if n not in CHAIN)
    graph = load_model(chain_plan.parent / "chain.onnx", 6).graph
    assert weight_only_ops(graph) == set(CHAIN)
    strategy = data_parallel(graph, analyze(graph), 3)
    assert load_plan(chain_plan).strategy(graph, analyze(graph)) == strategy


@pytest.mark.parametrize(
    ("op", "copies", "devices", "words"),
    [
        ("concat", 0, [0], "'ops[3].copies': must be an integer in [1, 1024], got 0"),
        ("concat", -2, [0], "'ops[3].copies': must be an integer in [1, 1024], got -2"),
        ("concat", 1.5, [0], "'ops[3].copies': must be int, got 1.5"),
        ("concat", True, [0], "'ops[3].copies': must be int, got true"),
        ("concat", 2, [0, 1, 2], "'ops[3].devices': has 3 entries; the degrees and 2 copies"),
        ("concat", 3, [0, 1, 1], "op 'concat': copies: a box's 3 copies must be on distinct"),
        ("matmul", 3, [0, 1, 2], "op 'matmul': copies = 3, but only an op that reads weights"),
    ],
)
def test_bad_copies_are_one_line_exit_2(
    chain_plan: Path, tmp_path: Path, capsys, op, copies, devices, words
) -> None:
    doc = json.loads(chain_plan.read_text())
    doc["model"]["path"] = str(chain_plan.parent / "chain.onnx")
    (entry,) = [o for o in doc["ops"] if o["name"] == op]
    entry["degrees"], entry["copies"], entry["devices"] = {}, copies, devices
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli(["simulate", str(bad), "--machine", "cpu:3"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_plans_without_copies_are_written_as_before(chain_plan: Path, tmp_path: Path) -> None:
    model = chain_plan.parent / "chain.onnx"
    one = tmp_path / "one.json"
    assert cli(["plan", str(model), "--devices", "1", "--batch", "6", "--strategy",
                "data-parallel", "--search", "none", "-o", str(one)]) == 0  # fmt: skip
    assert '"copies"' not in one.read_text()


def test_annotations_round_trip_copies(chain_plan: Path, tmp_path: Path) -> None:
    annotated = tmp_path / "annotated.onnx"
    assert cli(["annotate", str(chain_plan), "-o", str(annotated)]) == 0
    graph = load_model(chain_plan.parent / "chain.onnx", 6).graph
    space = analyze(graph)
    plan = read_annotated(annotated, lambda batch, loss: load_model(annotated, batch, loss))
    assert plan.strategy(graph, space) == load_plan(chain_plan).strategy(graph, space)
    assert {o.name: o.copies for o in plan.ops if o.copies > 1} == dict.fromkeys(CHAIN, 3)
    assert cli(["simulate", str(annotated), "--machine", "cpu:3"]) == 0
    # another tool's reading (the standard's fields alone): a weight-only op that every
    # device holds whole is copied on each of them
    model = onnx.load(str(annotated), load_external_data=False)
    drop_ours(model.metadata_props)
    for node in model.graph.node:
        drop_ours(node.metadata_props)
    standard = tmp_path / "standard.onnx"
    onnx.save(model, str(standard))
    derived = read_annotated(standard, lambda batch, loss: load_model(standard, batch, loss), 6)
    assert derived.strategy(graph, space) == load_plan(chain_plan).strategy(graph, space)
