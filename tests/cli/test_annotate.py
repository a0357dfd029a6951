"""Plans as ONNX multi-device annotations: ``annotate``, ``plan --annotate``, ``plan
--start`` and ``simulate`` of an annotated model (soap/annotations).

Round trips: every rule, and a random plan of every model the tests export, read back
from the annotated file as the plan it was (our metadata), and from the standard's
fields alone where they pin every piece down. Another tool's file (standard fields
only, hand-written) reads as a plan; bad annotations are one line, exit 2, and nothing
is half-written.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx2soap.cli import main as cli
from onnx2soap.cli.annotate_cmd import read_plan
from onnx2soap.importer import file_sha256
from onnx2soap.search.baselines import Rule
from onnx2soap.soap import Plan, load_plan
from onnx2soap.soap.annotations.metadata import OPS_KEY, PLAN_KEY, drop_ours
from tests.conftest import ExportModel
from tests.models import MODELS

BATCH = "4"
DEVICES = "4"


@pytest.fixture(scope="module")
def models(export_model: ExportModel, tmp_path_factory) -> Callable[[str, str], Path]:
    """``models(name, exporter)``: a copy of the exported model (and its external data)
    in a folder of this module's, where annotated files may be written beside it."""
    folder = tmp_path_factory.mktemp("annotate")
    copies: dict[tuple[str, str], Path] = {}

    def copy(name: str, exporter: str = "legacy") -> Path:
        if (name, exporter) not in copies:
            source = export_model(name, exporter)
            for f in source.parent.glob(f"{source.name}*"):  # the model and its .data
                shutil.copy(f, folder / f.name)
            copies[name, exporter] = folder / source.name
        return copies[name, exporter]

    return copy


def plan_and_annotate(model: Path, tag: str, *options: str) -> tuple[Path, Path]:
    plan, annotated = model.with_name(f"{tag}.json"), model.with_name(f"{tag}.onnx")
    args = ["plan", str(model), "--batch", BATCH, "--devices", DEVICES, *options]
    assert cli([*args, "-o", str(plan), "--annotate", str(annotated), "--json"]) == 0
    return plan, annotated


def same_plan(read: Plan, written: Plan, annotated: Path) -> None:
    """The annotated file's plan is the plan file's, its model the annotated file."""
    assert read.model_path == annotated and read.model_sha256 == file_sha256(annotated)
    assert (
        dataclasses.replace(written, model_path=annotated, model_sha256=read.model_sha256) == read
    )


def standard_only(annotated: Path) -> Path:
    """A copy of ``annotated`` without our metadata: the standard's fields alone."""
    model = onnx.load(str(annotated), load_external_data=False)
    drop_ours(model.metadata_props)
    for node in model.graph.node:
        drop_ours(node.metadata_props)
    out = annotated.with_name(f"{annotated.stem}.standard.onnx")
    onnx.save(model, str(out))
    return out


def node_ops(plan: Plan, model: Path) -> dict:
    """The configs of the ops that are nodes of ``model`` (the attached loss and a
    shared weight's Identity have no node: the standard says nothing of them)."""
    nodes = onnx.load(str(model), load_external_data=False).graph.node
    named = {n.name for n in nodes} | {o for n in nodes for o in n.output}
    return {o.name: o for o in plan.ops if o.name in named}


RULES = [r.value for r in Rule]
CNN_RULES = ("model-parallel", "megatron", "pipeline")  # a sample: the suite stays fast


@pytest.mark.parametrize(
    ("name", "exporter", "rule"),
    [("tied", "dynamo", r) for r in RULES] + [("cnn", "legacy", r) for r in CNN_RULES],
)
def test_every_rule_round_trips(models, name: str, exporter: str, rule: str) -> None:
    """The tied model (dynamo: external data, a shared weight, token ids) under every
    rule; the CNN (windows, a Concat) under a sample of them."""
    model = models(name, exporter)
    plan, annotated = plan_and_annotate(model, f"{name}-{rule}", "--strategy", rule)
    onnx.checker.check_model(str(annotated))  # the path: external data checked too
    written = load_plan(plan)
    same_plan(read_plan(annotated), written, annotated)
    if rule == "random":
        return  # devices repeat at random: the shardings may leave a piece to two
    # The standard's fields alone give every node's config (a pipeline's in one
    # microbatch: the standard has no microbatch count).
    standard = read_plan(standard_only(annotated), int(BATCH))
    assert node_ops(standard, model) == node_ops(written, model)
    assert (standard.pipeline is None) == (written.pipeline is None)
    if written.pipeline:
        assert standard.pipeline.stages == written.pipeline.stages


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_random_plan_of_every_model_round_trips(models, name: str) -> None:
    model = models(name, "dynamo" if name in ("tied", "mlp") else "legacy")
    seed = str(sorted(MODELS).index(name))
    plan, annotated = plan_and_annotate(
        model, f"{name}-random", "--strategy", "random", "--seed", seed
    )
    onnx.checker.check_model(str(annotated))
    same_plan(read_plan(annotated), load_plan(plan), annotated)


def test_the_annotation_states_the_plan_in_the_standards_terms(models) -> None:
    """Megatron's MLP on 4 devices: the first linear's output cut by columns, its input
    replicated; the second's contraction cut (a partial sum), its sum on all four."""
    model = models("mlp", "legacy")
    _, annotated = plan_and_annotate(model, "mlp-megatron", "--strategy", "megatron")
    proto = onnx.load(str(annotated))
    assert proto.ir_version >= 11
    assert [(c.name, c.num_devices) for c in proto.configuration] == [("onnx2soap", 4)]
    nodes = {n.name: n for n in proto.graph.node}
    fc1 = {s.tensor_name: s for s in nodes["/fc1/Gemm"].device_configurations[0].sharding_spec}
    out = fc1["/fc1/Gemm_output_0"]
    assert list(out.device) == [0, 1, 2, 3]
    assert [(d.axis, d.simple_sharding[0].num_shards) for d in out.sharded_dim] == [(1, 4)]
    data = fc1["input"]
    assert list(data.device) == [-1] and not data.sharded_dim
    assert list(data.index_to_device_group_map[0].value) == [0, 1, 2, 3]
    fc2 = {s.tensor_name: s for s in nodes["/fc2/Gemm"].device_configurations[0].sharding_spec}
    assert [(d.axis, d.simple_sharding[0].num_shards) for d in fc2["fc2.weight"].sharded_dim] == [
        (1, 4)
    ]
    summed = fc2["/fc2/Gemm_output_0"]
    assert list(summed.device) == [-1] and not summed.sharded_dim
    keys = {p.key for p in nodes["/fc2/Gemm"].metadata_props}
    assert OPS_KEY in keys and PLAN_KEY in {p.key for p in proto.metadata_props}


def test_an_annotated_plan_trains_as_the_plan_file(models, tmp_path: Path) -> None:
    from tests.executor.mpi import mpirun

    model = models("mlp", "dynamo")
    args = ["plan", str(model), "--batch", BATCH, "--devices", "2", "--strategy", "megatron"]
    plan, annotated = model.with_name("train.json"), model.with_name("train.onnx")
    assert cli([*args, "-o", str(plan), "--annotate", str(annotated), "--json"]) == 0
    by_file = mpirun(plan, 2, tmp_path, "--steps", "2")
    by_model = mpirun(annotated, 2, tmp_path, "--steps", "2")
    assert by_file.returncode == 0 and by_model.returncode == 0, by_model.stderr[-2000:]
    assert by_model.losses == by_file.losses and by_model.bytes_sent == by_file.bytes_sent
    for name, w in by_file.weights.items():
        np.testing.assert_array_equal(by_model.weights[name], w, err_msg=name)


# --- another tool's annotation: the standard's fields alone --------------------------------


def _spec(tensor: str, devices: list[int], cuts=(), groups=None) -> onnx.ShardingSpecProto:
    spec = onnx.ShardingSpecProto(tensor_name=tensor, device=devices)
    for axis, shards in cuts:
        spec.sharded_dim.add(axis=axis).simple_sharding.add(num_shards=shards)
    for key, members in (groups or {}).items():
        spec.index_to_device_group_map.add(key=key, value=members)
    return spec


def foreign(model: Path, out: Path, specs: dict, stages: dict | None = None, devices=2) -> Path:
    """``model`` annotated by hand: ``specs`` {node: [ShardingSpecProto]}, ``stages``
    {node: stage}, under one configuration "mesh" of ``devices``."""
    proto = onnx.load(str(model), load_external_data=False)
    proto.ir_version = max(proto.ir_version, 11)
    proto.configuration.add(name="mesh", num_devices=devices)
    for node in proto.graph.node:
        if node.name in specs or node.name in (stages or {}):
            entry = node.device_configurations.add(configuration_id="mesh")
            entry.sharding_spec.extend(specs.get(node.name, []))
            if stages and node.name in stages:
                entry.pipeline_stage = stages[node.name]
    onnx.save(proto, str(out))
    return out


def megatron_by_hand(mlp: Path) -> dict:
    """fc1 by samples, fc2 by its contraction (its sum on both), relu2 whole on device 0,
    fc3 by classes; relu1 and the loss not annotated."""
    both = {-1: [0, 1]}
    return {
        "/fc1/Gemm": [
            _spec("/fc1/Gemm_output_0", [0, 1], [(0, 2)]),
            _spec("fc1.weight", [-1], groups=both),
        ],
        "/fc2/Gemm": [
            _spec("/relu1/Relu_output_0", [0, 1], [(1, 2)]),
            _spec("fc2.weight", [0, 1], [(-1, 2)]),
            _spec("/fc2/Gemm_output_0", [-1], groups=both),
        ],
        "/relu2/Relu": [_spec("/relu2/Relu_output_0", [0])],
        "/fc3/Gemm": [_spec("logits", [0, 1], [(1, 2)])],
    }


def test_another_tools_annotation_reads_as_a_plan(models, capsys) -> None:
    mlp = models("mlp", "legacy")
    path = foreign(mlp, mlp.with_name("foreign.onnx"), megatron_by_hand(mlp))
    onnx.checker.check_model(str(path))
    plan = read_plan(path, int(BATCH))
    ops = {o.name: (dict(o.degrees), o.devices) for o in plan.ops}
    assert ops == {
        "/fc1/Gemm": ({"n": 2}, (0, 1)),
        "/relu1/Relu": ({"n": 2}, (0, 1)),  # its producer's layout (the standard's rule)
        "/fc2/Gemm": ({"ci": 2}, (0, 1)),  # a cut contraction: a partial sum
        "/relu2/Relu": ({}, (0,)),
        "/fc3/Gemm": ({"co": 2}, (0, 1)),
        "loss": ({}, (0,)),  # logits cut by classes: the loss cannot be, so whole
    }
    assert plan.devices == 2 and plan.batch == int(BATCH) and plan.pipeline is None
    capsys.readouterr()
    assert cli(["simulate", str(path), "--batch", BATCH, "--json"]) == 0
    start = mlp.with_name("from-foreign.json")
    args = ["plan", str(mlp), "--batch", BATCH, "--devices", "2", "--start", str(path)]
    assert cli([*args, "--search", "none", "-o", str(start), "--json"]) == 0
    assert {o.name: (dict(o.degrees), o.devices) for o in load_plan(start).ops} == ops


def test_another_tools_pipeline_stages(models) -> None:
    """Stages alone, each node on one device: a pipeline of one microbatch, the loss
    in its producer's stage."""
    mlp = models("mlp", "legacy")
    first, second = ["/fc1/Gemm", "/relu1/Relu", "/fc2/Gemm"], ["/relu2/Relu", "/fc3/Gemm"]
    stages = {n: 3 for n in first} | {n: 7 for n in second}  # numbered in their order
    specs = {n: [_spec(f"{n}_output_0", [0])] for n in first}
    specs["/relu2/Relu"] = [_spec("/relu2/Relu_output_0", [1])]
    specs["/fc3/Gemm"] = [_spec("logits", [1])]
    plan = read_plan(foreign(mlp, mlp.with_name("stages.onnx"), specs, stages), int(BATCH))
    assert plan.pipeline is not None and plan.pipeline.microbatches == 1
    assert plan.pipeline.stages == (tuple(first), (*second, "loss"))
    assert {o.name: o.devices for o in plan.ops} == {n: (0,) for n in first} | {
        n: (1,) for n in (*second, "loss")
    }


# --- bad input: one line naming the file, node and field; exit 2 ----------------------------


def one_line(capsys, *fragments: str) -> None:
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "Traceback" not in err and err.startswith("onnx2soap: error:")
    ), err
    for fragment in fragments:
        assert fragment in err, err


def _edited(mlp: Path, tag: str, edit: Callable[[dict], None]) -> Path:
    specs = megatron_by_hand(mlp)
    edit(specs)
    return foreign(mlp, mlp.with_name(f"{tag}.onnx"), specs)


BAD: list[tuple[str, Callable[[dict], None], tuple[str, ...]]] = [
    (
        "a device the machine lacks",
        lambda s: s["/fc3/Gemm"].__setitem__(0, _spec("logits", [0, 7], [(1, 2)])),
        ("node '/fc3/Gemm'", "sharding_spec[0].device[1]", "device 7 is not one of"),
    ),
    (
        "overlapping shards",
        lambda s: s["/fc3/Gemm"].__setitem__(0, _spec("logits", [0, 1, 0, 1], [(1, 2), (-1, 2)])),
        ("node '/fc3/Gemm'", "sharded_dim[1].axis", "overlapping shards"),
    ),
    (
        "a group naming a device the machine lacks",
        lambda s: s["/fc1/Gemm"].__setitem__(1, _spec("fc1.weight", [-1], groups={-1: [0, 2]})),
        ("node '/fc1/Gemm'", "index_to_device_group_map[0].value[1]", "device 2"),
    ),
    (
        "a replicated computation",
        lambda s: s.__setitem__(
            "/relu2/Relu", [_spec("/relu2/Relu_output_0", [-1], groups={-1: [0, 1]})]
        ),
        ("node '/relu2/Relu'", "sharding_spec '/relu2/Relu_output_0'", "devices [0, 1]"),
    ),
    (
        "more blocks than the dim has",
        lambda s: s["/fc3/Gemm"].__setitem__(0, _spec("logits", list(range(2)) * 8, [(1, 16)])),
        ("node '/fc3/Gemm'", "sharding_spec 'logits'", "at most 10 blocks"),
    ),
    (
        "shardings that disagree",
        lambda s: s["/fc3/Gemm"].append(_spec("/relu2/Relu_output_0", [1, 0], [(0, 2)])),
        ("node '/fc3/Gemm'", "no device holds every block", "co=0/2"),
    ),
    (
        "a tensor the node does not have",
        lambda s: s["/fc3/Gemm"].append(_spec("fc1.weight", [0])),
        ("node '/fc3/Gemm'", "sharding_spec[1].tensor_name", "'fc1.weight'"),
    ),
    (
        "shards that do not match the device list",
        lambda s: s["/fc3/Gemm"].__setitem__(0, _spec("logits", [0, 1, 1], [(1, 2)])),
        ("node '/fc3/Gemm'", "sharding_spec[0].device", "3 entries"),
    ),
]


@pytest.mark.parametrize(("what", "edit", "fragments"), BAD, ids=[b[0] for b in BAD])
def test_bad_annotations_are_one_line(models, capsys, what, edit, fragments) -> None:
    mlp = models("mlp", "legacy")
    path = _edited(mlp, what.replace(" ", "-"), edit)
    capsys.readouterr()
    assert cli(["simulate", str(path), "--batch", BATCH]) == 2
    one_line(capsys, path.name, *fragments)


def test_unknown_configuration_and_garbage(models, capsys) -> None:
    mlp = models("mlp", "legacy")
    proto = onnx.load(str(foreign(mlp, mlp.with_name("conf.onnx"), megatron_by_hand(mlp))))
    proto.graph.node[0].device_configurations[0].configuration_id = "other"
    onnx.save(proto, str(mlp.with_name("conf.onnx")))
    capsys.readouterr()
    assert cli(["simulate", str(mlp.with_name("conf.onnx")), "--batch", BATCH]) == 2
    one_line(capsys, "node '/fc1/Gemm'", "device_configurations[0].configuration_id", "'other'")
    garbage = mlp.with_name("garbage.onnx")
    garbage.write_bytes(b"\x08\xff\xff\xff not a model")
    assert cli(["simulate", str(garbage)]) == 2
    one_line(capsys, "garbage.onnx", "not an ONNX model")
    assert cli(["simulate", str(mlp)]) == 2  # a model with no annotations
    one_line(capsys, mlp.name, "no device configuration")
    theirs = foreign(mlp, mlp.with_name("no-batch.onnx"), megatron_by_hand(mlp))
    assert cli(["simulate", str(theirs)]) == 2  # the standard has no batch; ours is symbolic
    one_line(capsys, "no-batch.onnx", "give no batch", "--batch")


def test_our_annotation_changed_by_another_tool_is_refused(models, capsys) -> None:
    model = models("mlp", "legacy")
    _, annotated = plan_and_annotate(model, "changed", "--strategy", "megatron")
    proto = onnx.load(str(annotated))
    spec = proto.graph.node[0].device_configurations[0].sharding_spec[0]
    spec.device[:] = [3, 2, 1, 0]
    onnx.save(proto, str(annotated))
    capsys.readouterr()
    assert cli(["simulate", str(annotated)]) == 2
    one_line(capsys, "node '/fc1/Gemm'", "sharding_spec '/fc1/Gemm_output_0'", "onnx2soap.ops")


def test_nothing_is_half_written(models, tmp_path: Path, capsys) -> None:
    """An output path refused before the work; an annotated model of external data
    written where it cannot refer to the data: neither the plan nor the model written."""
    model = models("tied", "dynamo")
    plan = model.with_name("half.json")
    base = ["plan", str(model), "--batch", BATCH, "--devices", "2", "--strategy", "data-parallel"]
    assert cli([*base, "-o", str(plan), "--annotate", str(tmp_path / "half.txt")]) == 2
    one_line(capsys, "half.txt", "*.onnx")
    elsewhere = tmp_path / "elsewhere.onnx"
    assert cli([*base, "-o", str(plan), "--annotate", str(elsewhere)]) == 2
    one_line(capsys, "elsewhere.onnx", ".onnx.data", "outside the output's folder")
    assert not plan.exists() and not elsewhere.exists()
    assert cli([*base, "-o", str(plan)]) == 0
    assert cli(["annotate", str(plan), "-o", str(elsewhere)]) == 2
    one_line(capsys, "elsewhere.onnx", "outside the output's folder")
    assert not elsewhere.exists() and not list(tmp_path.glob(".elsewhere*"))
    assert cli(["annotate", str(plan), "-o", str(model)]) == 2
    one_line(capsys, "the plan's model itself")
    beside = model.with_name("beside.onnx")
    assert cli(["annotate", str(plan), "-o", str(beside)]) == 0
    same_plan(read_plan(beside), load_plan(plan), beside)


def test_start_from_an_annotated_plan(models, capsys) -> None:
    """``--start`` with ``--search none`` is the plan; with the search, the walk starts
    from it too (beside the rules' plans), and the plan is the start unless the search
    finds a faster one."""
    model = models("mlp", "legacy")
    written, annotated = plan_and_annotate(model, "start", "--strategy", "expert")
    again = model.with_name("again.json")
    base = ["plan", str(model), "--batch", BATCH, "--devices", DEVICES, "--start", str(annotated)]
    assert cli([*base, "--search", "none", "-o", str(again)]) == 0
    assert load_plan(again).ops == load_plan(written).ops
    capsys.readouterr()
    assert cli([*base, "--max-evals", "20", "--budget", "5", "-o", str(again), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["start"]["path"] == str(annotated)
    walked = [n for w in doc["walks"] for n in (w["start"], *w["also"])]
    assert "start" in walked  # walked, or named beside a rule's plan it equals
    best = min(doc["predicted_step_time_s"], doc["start"]["step_time_s"])
    assert doc["predicted_step_time_s"] == best
    assert cli([*base, "--strategy", "megatron", "-o", str(again)]) == 2
    one_line(capsys, "--start", "--strategy")
    wrong = ["plan", str(model), "--batch", BATCH, "--devices", "2", "--start", str(annotated)]
    assert cli([*wrong, "-o", str(again)]) == 2
    one_line(capsys, annotated.name, "4 devices")
