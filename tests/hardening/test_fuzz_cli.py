"""Seeded fuzzing of the CLI as a hostile user would: broken plan files, broken models and
odd option values of every class issue 8 found. Each case must be refused with exit code
2 and exactly one line on stderr, no traceback, within a time limit.

Cases run in-process (``onnx2soap.cli.main``) for speed, under an alarm that turns a hang
into a failure; a few run as real processes to prove the one-line contract end to end.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx2soap.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
SEED = 8
CASE_LIMIT_S = 10.0  # one refusal; most take milliseconds
MUTATIONS = 120  # random plan mutations (seeded)


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]


class Hang(Exception):
    """A case that gave no answer within its time limit."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def refused(case: Case, capsys) -> str:
    """Run one case in-process: exit 2, one stderr line, no traceback, in time."""
    capsys.readouterr()
    began = time.monotonic()
    with time_limit(CASE_LIMIT_S):
        code = cli(list(case.argv))
    err = capsys.readouterr().err
    assert code == 2, f"{case.name}: exit {code}: {err}"
    assert err.count("\n") == 1 and err.startswith("onnx2soap: error: "), f"{case.name}: {err}"
    assert "Traceback" not in err
    assert time.monotonic() - began < CASE_LIMIT_S
    return err


# --- the material: a model, a valid plan, broken copies ------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, example_onnx: Path) -> Path:
    folder = tmp_path_factory.mktemp("fuzz")
    shutil.copy(example_onnx, folder / "cnn.onnx")
    args = ["plan", str(folder / "cnn.onnx"), "--batch", "4", "--devices", "2"]
    assert cli([*args, "--strategy", "data-parallel", "-o", str(folder / "plan.json")]) == 0
    return folder


def valid_doc(work: Path) -> dict:
    return json.loads((work / "plan.json").read_text())


def write_plan(work: Path, name: str, content: str | bytes | dict) -> Path:
    path = work / f"{name}.json"
    if isinstance(content, dict):
        content = json.dumps(content)
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    path.write_bytes(content)
    return path


def _set(doc: dict, where: tuple, value: object) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    return doc


def _raw(doc: dict, where: tuple, text: str) -> str:
    """The document with the value at ``where`` replaced by raw JSON text."""
    marker = "__RAW_VALUE__"
    return json.dumps(_set(doc, where, marker)).replace(json.dumps(marker), text)


def plan_file_cases(work: Path) -> list[tuple[str, str | bytes | dict]]:
    """One or more broken plans per class of the issue."""
    doc = valid_doc(work)
    deep = "[" * 100_000 + "]" * 100_000
    fifo = work / "fifo.onnx"
    if not fifo.exists():
        os.mkfifo(fifo)
    return [
        # JSON depth and number size
        ("deep-document", deep),
        ("deep-field", _raw(doc, ("search",), deep)),
        ("deep-object", '{"a":' * 50_000 + "1" + "}" * 50_000),
        # an unterminated string of escaped quotes: quadratic for a naive string regex
        ("unterminated-escaped-quotes", '{"a": "' + '\\"' * 400_000),
        ("5000-digit-batch", _raw(doc, ("model", "batch"), "9" * 5000)),
        ("5000-digit-float", _raw(doc, ("predicted", "step_time_s"), "1" * 5000 + ".5")),
        ("float-overflow", _raw(doc, ("predicted", "step_time_s"), "1e400")),
        ("nan-constant", _raw(doc, ("predicted", "step_time_s"), "NaN")),
        ("infinity-constant", _raw(doc, ("devices",), "Infinity")),
        # paths
        ("nul-in-model-path", _set(doc, ("model", "path"), "cnn\0.onnx")),
        ("nul-in-machine", _set(doc, ("machine",), "cpu\0:2")),
        ("empty-model-path", _set(doc, ("model", "path"), "")),
        ("model-is-dev-zero", _set(doc, ("model", "path"), "/dev/zero")),
        ("model-is-a-fifo", _set(doc, ("model", "path"), str(fifo))),
        ("model-is-a-folder", _set(doc, ("model", "path"), str(work))),
        # batch and device counts
        ("batch-beyond-int64", _set(doc, ("model", "batch"), 2**63)),
        ("batch-beyond-int32", _set(doc, ("model", "batch"), 2**31)),
        ("batch-float", _raw(doc, ("model", "batch"), "1e9")),
        ("batch-zero", _set(doc, ("model", "batch"), 0)),
        ("devices-100000", _set(doc, ("devices",), 100_000)),
        ("devices-huge", _set(doc, ("devices",), 2**64)),
        ("device-index-huge", _set(doc, ("ops", 0, "devices"), [0, 2**40])),
        ("degree-huge", _set(doc, ("ops", 0, "degrees"), {"n": 10**30})),
        # machines
        ("machine-superscript", _set(doc, ("machine",), "cpu:²")),
        ("machine-arabic-digit", _set(doc, ("machine",), "cpu:٣")),
        ("machine-100000", _set(doc, ("machine",), "cpu:100000")),
        ("machine-other-size", _set(doc, ("machine",), "cpu:3")),
        ("machine-nodes-too-many", _set(doc, ("machine",), "flexflow-p100:100000")),
        ("machine-dev-zero", _set(doc, ("machine",), "/dev/zero")),
        # bytes
        ("not-utf8", b'{"format": "\xff\xfe"}'),
        ("lone-surrogate", json.dumps(doc).replace('"loss"', '"\\udcff"', 1)),
        ("empty", ""),
        ("truncated", json.dumps(doc)[:100]),
    ]


# values a mutation puts somewhere in a valid plan
ODD_VALUES: list[object] = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63,
    -(2**63),
    1e308,
    -1e308,
    0.5,
    "",
    "\0",
    "cpu:²",
    "²",
    "x" * 10_000,
    [],
    {},
    [[[[]]]],
    {"n": 2},
    [0, 1, 2],
]


def _paths(doc: object, prefix: tuple = ()) -> Iterator[tuple]:
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def mutations(doc: dict, count: int, seed: int) -> Iterator[tuple[str, dict]]:
    rng = random.Random(seed)
    paths = list(_paths(doc))
    for i in range(count):
        where = rng.choice(paths)
        value = rng.choice(ODD_VALUES)
        yield f"mutation-{i}-{'.'.join(map(str, where))}", _set(doc, where, value)


def test_broken_plan_files_are_refused_in_one_line(work: Path, capsys) -> None:
    for name, content in plan_file_cases(work):
        path = write_plan(work, name, content)
        refused(Case(name, ("simulate", str(path))), capsys)


def test_mutated_plans_are_refused_or_simulated(work: Path, capsys) -> None:
    """A random edit of a valid plan is refused in one line, or (when it happens to be a
    valid plan too) simulated; never a traceback, never a hang."""
    doc = valid_doc(work)
    outcomes = {0: 0, 2: 0}
    for name, mutated in mutations(doc, MUTATIONS, SEED):
        path = write_plan(work, "mutated", mutated)
        capsys.readouterr()
        with time_limit(CASE_LIMIT_S):
            code = cli(["simulate", str(path), "--json"])
        err = capsys.readouterr().err
        assert code in outcomes, f"{name}: exit {code}: {err}"
        assert "Traceback" not in err
        assert err.count("\n") == (1 if code == 2 else 0), f"{name}: {err}"
        outcomes[code] += 1
    assert outcomes[2] > MUTATIONS // 2  # most edits break the plan


# --- broken models ---------------------------------------------------------------------------


def _model_cases() -> list[tuple[str, Callable[[onnx.ModelProto], bytes | None]]]:
    def long_raw(m):
        m.graph.initializer[0].raw_data += b"\0\0\0\0"

    def short_raw(m):
        m.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data[:-4]

    def opset_99(m):
        m.opset_import[0].version = 99

    def two_opsets(m):
        m.opset_import.add(domain="ai.onnx", version=13)

    def bad_utf8(field: str):
        def mutate(m):
            node = m.graph.node[1]
            if field == "name":
                node.name = "ZZ"
            else:
                node.output[0] = "ZZ"
                m.graph.node[2].input[0] = "ZZ"
            return m.SerializeToString().replace(b"ZZ", b"Z\xff")

        return mutate

    def bad_utf8_graph(m):
        m.graph.name = "YY"
        return m.SerializeToString().replace(b"YY", b"\xc3\x28")

    return [
        ("raw-data-longer-than-dims", long_raw),
        ("raw-data-shorter-than-dims", short_raw),
        ("opset-99", opset_99),
        ("two-ai-onnx-opsets", two_opsets),
        ("node-name-not-utf8", bad_utf8("name")),
        ("tensor-name-not-utf8", bad_utf8("output")),
        ("graph-name-not-utf8", bad_utf8_graph),
    ]


def _attribute(m: onnx.ModelProto, node: str, name: str, value) -> None:
    (target,) = [n for n in m.graph.node if n.name == node]
    kept = [a for a in target.attribute if a.name != name]
    del target.attribute[:]
    target.attribute.extend([*kept, onnx.helper.make_attribute(name, value)])


# Semantically broken models the checker lets through: (name, mutation, the node to blame).
SEMANTIC = [
    ("conv-stride-0", lambda m: _attribute(m, "/conv1/Conv", "strides", [0, 0]), "/conv1/Conv"),
    ("conv-pads-short", lambda m: _attribute(m, "/conv1/Conv", "pads", [1, 1]), "/conv1/Conv"),
    (
        "conv-negative-pads",
        lambda m: _attribute(m, "/branch_a/conv/Conv", "pads", [-1, 0, 0, 0]),
        "/branch_a/conv/Conv",
    ),
    (
        "maxpool-dilation-0",
        lambda m: _attribute(m, "/pool1/MaxPool", "dilations", [0, 0]),
        "/pool1/MaxPool",
    ),
    ("gemm-alpha-nan", lambda m: _attribute(m, "/fc1/Gemm", "alpha", float("nan")), "/fc1/Gemm"),
    (
        "gemm-bias-does-not-broadcast",
        lambda m: _replace_initializer(m, "/fc2/Gemm", 2, np.zeros(11, np.float32)),
        "/fc2/Gemm",
    ),
]


def _replace_initializer(m: onnx.ModelProto, node: str, index: int, value: np.ndarray) -> None:
    (target,) = [n for n in m.graph.node if n.name == node]
    (init,) = [i for i in m.graph.initializer if i.name == target.input[index]]
    init.CopyFrom(numpy_helper.from_array(value, init.name))


@pytest.mark.parametrize(("name", "mutate", "blame"), SEMANTIC, ids=[s[0] for s in SEMANTIC])
def test_semantically_broken_models_name_the_node_at_fault(
    work: Path, capsys, name: str, mutate, blame: str
) -> None:
    model = onnx.load(work / "cnn.onnx")
    mutate(model)
    path = work / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())
    line = refused(Case(name, ("inspect", str(path), "--batch", "2")), capsys)
    assert f"'{blame}'" in line, line


@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_broken_models_are_refused_in_one_line(work: Path, capsys, command: str) -> None:
    base = onnx.load(work / "cnn.onnx")
    for name, mutate in _model_cases():
        model = onnx.ModelProto()
        model.CopyFrom(base)
        data = mutate(model)
        path = work / f"{name}.onnx"
        path.write_bytes(data if isinstance(data, bytes) else model.SerializeToString())
        argv = [command, str(path), "--batch", "2"]
        if command == "plan":
            argv += ["--devices", "2", "--strategy", "data-parallel", "-o", str(work / "x.json")]
        refused(Case(name, tuple(argv)), capsys)


def test_planning_never_reads_weights_so_nonfinite_ones_plan(work: Path, capsys) -> None:
    """NaN in a weight is the executor's to refuse (it loads the values): planning reads
    shapes only (tests/executor/test_refusals.py has the refusal)."""
    base = onnx.load(work / "cnn.onnx")
    t = base.graph.initializer[0]
    a = numpy_helper.to_array(t).copy()
    a.flat[0] = np.nan
    t.CopyFrom(numpy_helper.from_array(a, t.name))
    path = work / "nan-weight.onnx"
    path.write_bytes(base.SerializeToString())
    assert cli(["inspect", str(path), "--batch", "2"]) == 0
    plan = ["plan", str(path), "--batch", "2", "--devices", "2", "--strategy", "data-parallel"]
    assert cli([*plan, "-o", str(work / "nan-plan.json")]) == 0


# --- odd option values ----------------------------------------------------------------------


def option_cases(work: Path) -> list[Case]:
    model, plan = str(work / "cnn.onnx"), str(work / "plan.json")
    out = str(work / "out.json")
    planned = ["plan", model, "--batch", "4", "-o", out]
    searched = [*planned, "--devices", "2"]
    cases = []
    for value in ["0", "-1", "2147483648", str(2**63), "1e9", "nan", "²", "٣", "1_0", "", "x"]:
        cases.append(Case(f"inspect --batch {value!r}", ("inspect", model, "--batch", value)))
    for value in ["0", "-5", "100000", "4097", "²", "2.0"]:
        cases.append(Case(f"--devices {value!r}", (*planned, "--devices", value)))
    for value in ["nan", "inf", "-inf", "-1", "1e308", "-1e308", "1e400"]:
        cases.append(Case(f"--budget {value}", (*searched, "--budget", value)))
    for value in ["-1e308", "nan", "inf", "-1", "1e400", "1e308"]:
        cases.append(Case(f"--beta {value}", (*searched, "--beta", value)))
    for value in ["0", "-1", "1e3", str(2**70), "nan"]:
        cases.append(Case(f"--max-evals {value}", (*searched, "--max-evals", value)))
    for value in ["-1", str(2**64), "0.5", "nan"]:
        cases.append(Case(f"--seed {value}", (*searched, "--seed", value)))
    for value in ["cpu:²", "cpu:100000", "cpu:0", "cpu:", "dgx-h100:1000", "\0", "cpu:1" * 2000]:
        cases.append(Case(f"--machine {value[:20]!r}", (*planned, "--machine", value)))
    cases += [
        Case("probe -n 0", ("machine", "probe", "-n", "0", "-o", out)),
        Case("probe -n 100000", ("machine", "probe", "-n", "100000", "-o", out)),
        Case("probe --seconds nan", ("machine", "probe", "-n", "2", "-o", out, "--seconds", "nan")),
        Case("probe -o /dev/null", ("machine", "probe", "-n", "2", "-o", "/dev/null")),
        Case("show cpu:²", ("machine", "show", "cpu:²")),
        Case("show cpu:100000", ("machine", "show", "cpu:100000")),
        Case("simulate --machine cpu:3", ("simulate", plan, "--machine", "cpu:3")),
        Case("simulate --machine cpu:²", ("simulate", plan, "--machine", "cpu:²")),
        Case("simulate --model /dev/zero", ("simulate", plan, "--model", "/dev/zero")),
        Case("simulate --trace /dev/null", ("simulate", plan, "--trace", "/dev/null")),
        Case("plan -o /dev/null", (*searched, "--strategy", "expert", "-o", "/dev/null")),
        Case("plan -o folder", (*searched, "--strategy", "expert", "-o", str(work))),
        Case("unknown option", ("plan", model, "--bogus")),
        Case("no command", ()),
    ]
    return cases


def test_odd_option_values_are_refused_in_one_line(work: Path, capsys) -> None:
    for case in option_cases(work):
        err = refused(case, capsys)
        if case.argv and case.argv[-2:-1] in (("--budget",), ("--beta",), ("--seed",)):
            assert case.argv[-2] in err, err  # names the option


# --- the one-line contract in real processes ------------------------------------------------


def run_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "onnx2soap", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "default"},
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_refusals_in_a_real_process(work: Path) -> None:
    doc = valid_doc(work)
    deep = write_plan(work, "p-deep", "[" * 100_000 + "]" * 100_000)
    zero = write_plan(work, "p-zero", _set(doc, ("model", "path"), "/dev/zero"))
    fifo = write_plan(work, "p-fifo", _set(doc, ("model", "path"), str(work / "fifo.onnx")))
    if not (work / "fifo.onnx").exists():
        os.mkfifo(work / "fifo.onnx")
    model = str(work / "cnn.onnx")
    for argv in [
        ("simulate", str(deep)),
        ("simulate", str(zero)),
        ("simulate", str(fifo)),
        ("plan", model, "--batch", "4", "--devices", "2", "--beta", "-1e308", "-o", "x.json"),
        ("inspect", model, "--batch", str(2**63)),
    ]:
        done = run_process(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stdout == ""


def test_same_seed_same_plan_bytes(work: Path) -> None:
    model = str(work / "cnn.onnx")
    first, second = work / "s1" / "plan.json", work / "s2" / "plan.json"
    for out in (first, second):
        argv = ["plan", model, "--batch", "4", "--devices", "2", "--seed", "3", "--quiet"]
        assert cli([*argv, "--max-evals", "40", "--budget", "120", "-o", str(out)]) == 0
    assert first.read_bytes() == second.read_bytes()
    search = json.loads(first.read_text())["search"]
    assert search["evaluated"] > 1 and not any("time" in key for key in search)
