"""Checkpoints under a real mpiexec.

- Stopped at step k and resumed: bit-identical to the uninterrupted run (losses and every
  weight, state and Adam moment), on a random plan with BatchNorm and Dropout on.
- Resumed under another plan (3 ranks then 2 with SGD, 2 then 3 with Adam's moments):
  re-sharded, it trains on like one device (float64, 1e-10). The checkpoint is
  safetensors files that the safetensors library opens: its shards, put together by
  their keys' boxes, are the weights the run saved, bit for bit.
- A checkpoint of format 1 (.npy files and a manifest) still resumes, like its format-2
  twin.
- mpiexec killed at any moment while checkpointing every step: the newest checkpoint is
  whole, and the run resumes from it; a half-written checkpoint is never read.
- A checkpoint of another model, batch, dtype, seed or optimizer is refused in one line.
- A checkpoint that lies (a header's length, offsets or dtype; a truncated or missing
  file; an index naming a tensor no file holds), fuzzed too: one line naming the file
  and the field, exit 2 on every rank, nothing written.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from safetensors.numpy import load_file

from executor.checkpoint import read_manifest
from executor.kinds import DeviceKind
from executor.optim import OptimizerConfig, OptimizerKind
from executor.train import RunOptions, RunResult, train
from onnx2soap.errors import UserError
from onnx2soap.ir import DType
from tests.executor.mpi import MPIEXEC, assert_same_training, make_plan, mpirun
from tests.executor.test_refusals import assert_refused

pytestmark = pytest.mark.mpi
BATCH, LR = 4, 0.05
ADAM = ("--optimizer", "adam", "--lr", str(LR), "--dtype", "float64")


@pytest.fixture(scope="module")
def bnnet(export_model, tmp_path_factory):
    """The BatchNorm + Dropout model and plans: random on 3 ranks and on 2 ranks."""
    model = export_model("bnnet")
    folder = tmp_path_factory.mktemp("ckpt-plans")
    plans = {}
    for ranks, seed in ((3, 4), (2, 9), (1, 0)):
        plans[ranks] = folder / f"plan-{ranks}.json"
        strategy = "data-parallel" if ranks == 1 else "random"
        make_plan(model, plans[ranks], ranks, BATCH, strategy, seed)
    return model, plans


def test_resumed_run_is_bit_identical(bnnet, tmp_path: Path):
    _, plans = bnnet
    whole = mpirun(plans[3], 3, tmp_path, "--steps", "4", *ADAM)
    assert whole.returncode == 0, whole.stderr[-2000:]
    folder = tmp_path / "ckpt"
    first = mpirun(plans[3], 3, tmp_path, "--steps", "2", *ADAM, "--checkpoint", str(folder))
    assert first.returncode == 0, first.stderr[-2000:]
    assert read_manifest(folder)[0].step == 2
    rest = mpirun(plans[3], 3, tmp_path, "--steps", "4", *ADAM, "--resume", str(folder))
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert first.losses + rest.losses == whole.losses  # exactly
    for name, w in whole.weights.items():
        np.testing.assert_array_equal(rest.weights[name], w, err_msg=name)


def _one_device(
    plan: Path, steps: int, optimizer: str, resume: Path | None = None, **extra
) -> RunResult:
    """The run on one device, in this process (numpy, float64)."""
    options = RunOptions(
        plan=plan,
        steps=steps,
        lr=LR,
        dtype=DType.FLOAT64,
        device=DeviceKind.CPU,
        optimizer=OptimizerConfig(OptimizerKind(optimizer)),
        resume=resume,
        **extra,
    )
    return train(MPI.COMM_SELF, options, gather=True)


def _whole_tensors(step: Path, field: str = "weight_map") -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint put together from its shards, read by the safetensors
    library alone (a key is the tensor's name and its box, ``name[lo:hi,...]``, then an
    optimizer slot's ``.name``)."""
    index = json.loads((step / "model.safetensors.index.json").read_text())
    shards = {}
    for file in sorted(set(index[field].values())):
        shards |= load_file(str(step / file))
    parts: dict[str, list] = {}
    for key in index[field]:
        name, box, slot = re.fullmatch(r"(.+)\[([0-9:,]*)\]((?:\.\w+)?)", key).groups()
        where = tuple(slice(*map(int, r.split(":"))) for r in box.split(",")) if box else ()
        parts.setdefault(name + slot, []).append((where, shards[key]))
    return {name: _put_together(name, boxes) for name, boxes in parts.items()}


def _put_together(name: str, boxes: list[tuple[tuple[slice, ...], np.ndarray]]) -> np.ndarray:
    shape = [max(where[axis].stop for where, _ in boxes) for axis in range(len(boxes[0][0]))]
    out, seen = np.full(shape, np.nan), np.zeros(shape, dtype=int)
    for where, values in boxes:
        out[where], seen[where] = values, seen[where] + 1
    assert (seen == 1).all(), f"{name}: every element is saved once"
    return out


@pytest.mark.parametrize(("before", "after", "optimizer"), [(3, 2, "sgd"), (2, 3, "adam")])
def test_resumed_under_another_plan_trains_like_one_device(
    bnnet, tmp_path: Path, before: int, after: int, optimizer: str
):
    _, plans = bnnet
    one = _one_device(plans[1], 4, optimizer)
    losses = [r.loss for r in one.steps]
    folder = tmp_path / "ckpt"
    args = ("--optimizer", optimizer, "--lr", str(LR), "--dtype", "float64")
    first = mpirun(
        plans[before], before, tmp_path, "--steps", "2", *args, "--checkpoint", str(folder)
    )
    rest = mpirun(plans[after], after, tmp_path, "--steps", "4", *args, "--resume", str(folder))
    assert first.returncode == 0 and rest.returncode == 0, first.stderr + rest.stderr
    np.testing.assert_allclose(first.losses + rest.losses, losses, rtol=1e-10)
    assert_same_training(rest, losses[2:], one.weights, rtol=1e-10)
    _, step = read_manifest(folder)
    whole = _whole_tensors(step)
    assert set(whole) == set(first.weights)
    for name, w in first.weights.items():
        np.testing.assert_array_equal(whole[name], w, err_msg=name)
    slots = {"sgd": set(), "adam": {"exp_avg", "exp_avg_sq"}}[optimizer]
    if slots:  # Adam's moments: whole, each element once, finite
        moments = _whole_tensors(step, "optimizer_map")
        assert {name.rsplit(".", 1)[1] for name in moments} == slots
        assert all(np.isfinite(m).all() for m in moments.values())


def test_killed_while_checkpointing_resumes_from_a_whole_checkpoint(bnnet, tmp_path: Path):
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    command = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "executor", "run", str(plans[2])]
    args = ["--steps", "100000", "--checkpoint", str(folder), "--checkpoint-every", "1"]
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (folder / "LATEST").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(7).uniform(0.05, 0.5))  # somewhere in a later write
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    subprocess.run(["pkill", "-9", "-f", str(plans[2])], check=False)  # orphaned ranks
    manifest, path = read_manifest(folder)
    assert manifest.step >= 1
    assert all((path / e.file).exists() for e in manifest.entries)
    more = str(manifest.step + 1)
    rest = mpirun(plans[2], 2, tmp_path, "--steps", more, "--resume", str(folder))
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert len(rest.losses) == 1


def test_a_half_written_checkpoint_is_never_read(bnnet, tmp_path: Path):
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    assert (
        mpirun(plans[2], 2, tmp_path, "--steps", "1", "--checkpoint", str(folder)).returncode == 0
    )
    half = folder / ".tmp-step-000000002"
    half.mkdir()
    (half / "model-rank00000.safetensors").write_bytes(b"\x10\0\0")
    assert read_manifest(folder)[0].step == 1
    run = mpirun(plans[2], 2, tmp_path, "--steps", "2", "--resume", str(folder))
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (("--seed", "3"), "--seed 0"),
        (("--optimizer", "adam"), "--optimizer sgd"),
        (("--dtype", "float64"), "--dtype float32"),
    ],
)
def test_an_incompatible_checkpoint_is_refused(bnnet, tmp_path: Path, change, said):
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    assert (
        mpirun(plans[2], 2, tmp_path, "--steps", "1", "--checkpoint", str(folder)).returncode == 0
    )
    run = mpirun(plans[2], 2, tmp_path, "--steps", "2", "--resume", str(folder), *change)
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.startswith("executor")]
    assert len(lines) == 1 and said in lines[0], run.stderr


def test_a_checkpoint_of_another_model_is_refused(bnnet, export_model, tmp_path: Path):
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    assert (
        mpirun(plans[2], 2, tmp_path, "--steps", "1", "--checkpoint", str(folder)).returncode == 0
    )
    other = tmp_path / "mlp.json"
    make_plan(export_model("mlp"), other, 2, BATCH, "data-parallel")
    run = mpirun(other, 2, tmp_path, "--steps", "2", "--resume", str(folder))
    assert run.returncode == 2 and "another model" in run.stderr
    missing = mpirun(other, 2, tmp_path, "--steps", "2", "--resume", str(tmp_path / "none"))
    assert missing.returncode == 2 and "no checkpoint" in missing.stderr
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def saved(bnnet, tmp_path_factory) -> Path:
    """A checkpoint of two Adam steps on 3 ranks (float64)."""
    _, plans = bnnet
    folder = tmp_path_factory.mktemp("saved")
    checkpoint = folder / "ckpt"
    run = mpirun(plans[3], 3, folder, "--steps", "2", *ADAM, "--checkpoint", str(checkpoint))
    assert run.returncode == 0, run.stderr[-2000:]
    return checkpoint


def _as_format_1(source: Path, target: Path) -> None:
    """``source`` as format 1 kept it: manifest.json and a .npy per saved Rect (here one
    per whole tensor, so restoring re-shards them)."""
    manifest, step = read_manifest(source)
    folder = target / step.name
    folder.mkdir(parents=True)
    entries = []
    for field in ("weight_map", "optimizer_map"):
        for i, (name, values) in enumerate(_whole_tensors(step, field).items()):
            tensor, kind = name.rsplit(".", 1) if field == "optimizer_map" else (name, "value")
            np.save(folder / f"{field}-{i}.npy", values)
            rect = [[0, n] for n in values.shape]
            entries.append(
                {"tensor": tensor, "kind": kind, "rect": rect, "file": f"{field}-{i}.npy"}
            )
    identity = asdict(manifest.identity)
    doc = {"format": 1, "identity": identity, "plan_sha256": manifest.plan_sha256}
    doc |= {"step": manifest.step, "entries": entries, "loss_scale": None}
    (folder / "manifest.json").write_text(json.dumps(doc))
    (target / "LATEST").write_text(step.name + "\n")


def test_a_format_1_checkpoint_still_resumes(bnnet, saved, tmp_path: Path) -> None:
    _, plans = bnnet
    _as_format_1(saved, tmp_path / "old")
    new = _one_device(plans[1], 3, "adam", resume=saved)
    old = _one_device(plans[1], 3, "adam", resume=tmp_path / "old")
    assert [r.loss for r in old.steps] == [r.loss for r in new.steps] and len(new.steps) == 1
    for name, w in new.weights.items():
        np.testing.assert_array_equal(old.weights[name], w, err_msg=name)


def _latest(folder: Path) -> Path:
    return folder / (folder / "LATEST").read_text().strip()


def _edit_header(file: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header through ``edit(header)``, data kept."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])


def _first_tensor(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


def _flip(file: Path, at: int, bits: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= bits
    file.write_bytes(bytes(data))


def _edit_index(step: Path, edit) -> None:
    index = step / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    edit(doc)
    index.write_text(json.dumps(doc))


def _shift(entry: dict) -> None:
    entry["data_offsets"] = [o + 10**6 for o in entry["data_offsets"]]


LIES = {
    # what is wrong: (the lie told to a copy of the checkpoint's folder, the line says)
    "truncated": (
        lambda s: (s / "model-rank00001.safetensors").write_bytes(
            (s / "model-rank00001.safetensors").read_bytes()[:-100]
        ),
        ("model-rank00001.safetensors", "data_offsets", "inside the file"),
    ),
    "header length": (
        lambda s: _flip(s / "model-rank00000.safetensors", 5, 0xFF),
        ("model-rank00000.safetensors", "a header of"),
    ),
    "header length by one": (
        lambda s: _flip(s / "optimizer-rank00002.safetensors", 0, 0x08),
        ("optimizer-rank00002.safetensors", "not JSON"),
    ),
    "offsets beyond the file": (
        lambda s: _edit_header(
            s / "model-rank00002.safetensors", lambda h: _shift(_first_tensor(h))
        ),
        ("model-rank00002.safetensors", "data_offsets", "inside the file"),
    ),
    "dtype unknown": (
        lambda s: _edit_header(
            s / "optimizer-rank00001.safetensors",
            lambda h: _first_tensor(h).update(dtype="Q64"),
        ),
        ("optimizer-rank00001.safetensors", "dtype 'Q64'"),
    ),
    "missing file": (
        lambda s: (s / "optimizer-rank00002.safetensors").unlink(),
        ("optimizer-rank00002.safetensors", "optimizer_map", "not a file beside it"),
    ),
    "a tensor no file has": (
        lambda s: _edit_index(
            s, lambda d: d["weight_map"].update({"ghost[0:1]": "model-rank00000.safetensors"})
        ),
        ("model-rank00000.safetensors", "no tensor 'ghost[0:1]'"),
    ),
    "a shard left out of the index": (
        lambda s: _edit_index(s, lambda d: d["weight_map"].pop(sorted(d["weight_map"])[0])),
        ("step-000000002", "no saved shard holds all of"),
    ),
    "index not JSON": (
        lambda s: (s / "model.safetensors.index.json").write_text('{"metadata": '),
        ("model.safetensors.index.json", "not JSON"),
    ),
    "no step": (
        lambda s: _edit_index(s, lambda d: d["metadata"].pop("step")),
        ("model.safetensors.index.json", "'step'"),
    ),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_checkpoint_that_lies_is_refused_in_one_line(bnnet, saved, tmp_path: Path, lie):
    _, plans = bnnet
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    tell, fragments = LIES[lie]
    tell(_latest(copy))
    with pytest.raises(UserError) as refused:
        _one_device(plans[1], 3, "adam", resume=copy, checkpoint=tmp_path / "out")
    message = str(refused.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    assert not (tmp_path / "out").exists()


def test_fuzzed_headers_are_read_or_refused_in_one_line(saved, tmp_path: Path) -> None:
    """Bits flipped in a file's header length or JSON: the checkpoint reads (every shard
    inside its file) or is refused in one line naming the file; never another error."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    files = sorted(_latest(copy).glob("*.safetensors"))
    rng, refused = random.Random(11), 0
    for _ in range(60):
        file = rng.choice(files)
        whole = file.read_bytes()
        (length,) = struct.unpack("<Q", whole[:8])
        for _ in range(rng.randint(1, 3)):
            _flip(file, rng.randrange(8 + length), 1 << rng.randrange(8))
        try:
            manifest, _ = read_manifest(copy)
            for entry in manifest.entries:
                entry.stored.read()
        except UserError as e:
            assert "\n" not in str(e) and file.name in str(e), str(e)
            refused += 1
        file.write_bytes(whole)
    assert refused > 40


def test_refused_on_every_rank_with_nothing_written(bnnet, saved, tmp_path: Path) -> None:
    _, plans = bnnet
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    LIES["offsets beyond the file"][0](_latest(copy))
    out = tmp_path / "out"
    run = mpirun(
        plans[2],
        2,
        tmp_path,
        "--steps",
        "3",
        *ADAM,
        "--resume",
        str(copy),
        "--checkpoint",
        str(out),
    )
    assert run.returncode == 2
    assert_refused(run, "model-rank00002.safetensors", "data_offsets")
    assert not out.exists() and not list(tmp_path.glob("*.npz")), list(tmp_path.iterdir())


def test_a_step_saved_again_gets_a_fresh_folder(bnnet, tmp_path: Path) -> None:
    """LATEST names the first save of step 1 until the second is whole: the second
    cannot take its folder's name."""
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    for _ in range(2):
        _one_device(plans[1], 1, "sgd", checkpoint=folder)
    manifest, step = read_manifest(folder)
    assert manifest.step == 1 and step.name == "step-000000001.1"
    assert sorted(p.name for p in folder.iterdir()) == ["LATEST", step.name]
