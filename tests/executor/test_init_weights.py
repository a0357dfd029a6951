"""``--init-weights FILE|DIR``: training starts from safetensors weights written by the
safetensors library itself (an independent writer), each rank reading its shards; bad
files and names are one line.

The example CNN on a random plan over 3 ranks, float64, learning rate 0: the weights the
run saves are the file's, every shard read where the plan put it. A Hugging Face folder
(two files and model.safetensors.index.json, one of them float16) too.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from safetensors.numpy import save_file

from executor.cli import main as executor_main
from executor.init_weights import INDEX, read_tensors
from executor.kinds import DeviceKind
from executor.train import RunOptions, train
from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from tests.executor.mpi import make_plan, mpirun
from tests.executor.test_refusals import assert_refused

pytestmark = pytest.mark.mpi
RANKS, BATCH = 3, 6


@pytest.fixture(scope="module")
def cnn(tmp_path_factory, example_onnx: Path) -> dict:
    folder = tmp_path_factory.mktemp("init")
    model = folder / "cnn.onnx"
    shutil.copy(example_onnx, model)
    plans = {"random": folder / "random.json", "one": folder / "one.json"}
    make_plan(model, plans["random"], RANKS, BATCH, "random", 3)
    make_plan(model, plans["one"], 1, BATCH, "single-device")
    graph = load_model(model, BATCH).graph
    rng = np.random.default_rng(0)
    values = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.weights}
    return {"folder": folder, "plans": plans, "values": values}


def _unchanged(run, expected: dict[str, np.ndarray]) -> None:
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.weights is not None and set(run.weights) == set(expected)
    for name, w in expected.items():
        np.testing.assert_array_equal(run.weights[name], w.astype(np.float64), err_msg=name)


def test_a_file_gives_every_rank_its_shards(cnn, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(cnn["values"], str(path))
    args = ("--init-weights", str(path), "--lr", "0", "--steps", "1", "--dtype", "float64")
    _unchanged(mpirun(cnn["plans"]["random"], RANKS, tmp_path, *args), cnn["values"])


def test_a_hugging_face_folder_with_its_index(cnn, tmp_path: Path) -> None:
    """Two files named by the index's weight map; the second stores float16 (widened
    exactly); the model's own values stay for a tensor the files leave out."""
    values = dict(cnn["values"])
    names = sorted(values)
    first = {n: values[n] for n in names[:4]}
    second = {n: values[n].astype(np.float16) for n in names[4:-1]}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in second}
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    left_out = names[-1]
    own = load_model(cnn["folder"] / "cnn.onnx", BATCH).values()[left_out]
    expected = {**first, **{n: v.astype(np.float32) for n, v in second.items()}, left_out: own}
    args = ("--init-weights", str(tmp_path), "--lr", "0", "--steps", "1", "--dtype", "float64")
    _unchanged(mpirun(cnn["plans"]["random"], RANKS, tmp_path, *args), expected)


def _refused(cnn, source: Path, *fragments: str) -> None:
    options = RunOptions(
        plan=cnn["plans"]["one"], steps=1, device=DeviceKind.CPU, init_weights=source
    )
    with pytest.raises(UserError) as refused:
        train(MPI.COMM_SELF, options)
    message = str(refused.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def _write(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_names_and_shapes_that_match_nothing_are_refused(cnn, tmp_path: Path) -> None:
    values = cnn["values"]
    stray = tmp_path / "stray.safetensors"
    save_file({"encoder.weight": values["fc2.bias"]}, str(stray))
    _refused(cnn, stray, "stray.safetensors", "'encoder.weight'", "none of the model's")
    shaped = tmp_path / "shaped.safetensors"
    save_file({"fc2.bias": np.zeros(11, np.float32)}, str(shaped))
    _refused(cnn, shaped, "shaped.safetensors", "'fc2.bias'", "[11]", "[10]")
    _refused(cnn, tmp_path / "absent", "absent", "no such file or folder")
    two = tmp_path / "two"
    two.mkdir()
    save_file({"fc2.bias": values["fc2.bias"]}, str(two / "a.safetensors"))
    save_file({"fc1.bias": values["fc1.bias"]}, str(two / "b.safetensors"))
    _refused(cnn, two, "2 .safetensors files", INDEX)


def _bias(dtype: str = "F32", shape=(10,), offsets=(0, 40)) -> dict:
    return {"fc2.bias": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


@pytest.mark.parametrize(
    ("header", "data", "fragment"),
    [
        (b"{not json", b"", "not JSON"),
        (b"[1, 2]", b"", "not a JSON object"),
        (_bias("I8", offsets=(0, 10)), b"\0" * 10, "I8"),
        (_bias(), b"\0" * 8, "inside"),  # the data ends before the tensor does
        (_bias(offsets=(0, 36)), b"\0" * 40, "[0, 36]"),  # not 10 floats
        (_bias(shape=(-10,)), b"\0" * 40, "integers"),
        ({"fc2.bias": [1, 2]}, b"", "mapping"),
    ],
)
def test_a_header_that_lies_is_refused(cnn, tmp_path: Path, header, data, fragment) -> None:
    _refused(cnn, _write(tmp_path / "bad.safetensors", header, data), "bad.safetensors", fragment)


def test_a_truncated_file_is_refused(cnn, tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x10\0\0")
    _refused(cnn, path, "short.safetensors", "shorter than its header")
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    _refused(cnn, path, "short.safetensors", "a header of")


def test_refused_on_every_rank_in_one_line(cnn, tmp_path: Path) -> None:
    shaped = tmp_path / "shaped.safetensors"
    save_file({"fc1.weight": np.zeros((2, 2), np.float32)}, str(shaped))
    run = mpirun(cnn["plans"]["random"], RANKS, tmp_path, "--init-weights", str(shaped))
    assert_refused(run, "shaped.safetensors", "'fc1.weight'", "[2, 2]")


def test_init_weights_with_resume_is_refused(cnn, tmp_path: Path, capsys) -> None:
    plan = str(cnn["plans"]["one"])
    argv = ["run", plan, "--init-weights", str(tmp_path), "--resume", str(tmp_path)]
    assert executor_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--init-weights and --resume" in err[0]


@settings(max_examples=200, deadline=None)
@given(
    header=st.one_of(
        st.binary(max_size=64),
        st.dictionaries(
            st.text(max_size=8),
            st.fixed_dictionaries(
                {
                    "dtype": st.sampled_from(["F32", "F16", "BF16", "F64", "I8", 3, [1]]),
                    "shape": st.lists(st.integers(-2, 6), max_size=3),
                    "data_offsets": st.lists(st.integers(-8, 300), max_size=3),
                }
            ),
            max_size=3,
        ).map(lambda d: json.dumps(d).encode()),
    ),
    data=st.integers(0, 256),
    length=st.one_of(st.none(), st.integers(0, 1 << 62)),
)
def test_any_header_is_read_or_refused_in_one_line(tmp_path_factory, header, data, length):
    """Fuzzed: whatever the header says, reading it returns tensors inside the file or
    refuses in one line (never another exception)."""
    path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
    size = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", size) + header + b"\0" * data)
    try:
        tensors = read_tensors(path)
    except UserError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return
    end = path.stat().st_size
    for t in tensors.values():
        assert t.where.offset + t.where.length <= end
