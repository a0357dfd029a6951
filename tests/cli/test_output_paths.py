"""Output paths are checked before any work; a symlink is written through to its target
(atomically there); a device node, FIFO or folder is refused, never replaced."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from executor.train import RunOptions, train
from onnx2soap.cli import main as cli
from onnx2soap.errors import UserError
from onnx2soap.files import check_input, check_output, write_atomic


@pytest.fixture
def model(tmp_path: Path, example_onnx: Path) -> Path:
    path = tmp_path / "cnn.onnx"
    shutil.copy(example_onnx, path)
    return path


def plan_args(model: Path, out: Path | str) -> list[str]:
    return [
        "plan",
        str(model),
        "--batch",
        "4",
        "--devices",
        "2",
        "--strategy",
        "expert",
        "-o",
        str(out),
    ]


def one_line(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def test_a_symlink_is_written_through(tmp_path: Path, model: Path) -> None:
    target = tmp_path / "real" / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert cli(plan_args(model, link)) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["format"] == "onnx2soap.plan"
    assert not list(tmp_path.glob(".*.tmp")) and not list(target.parent.glob(".*.tmp"))


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "link.npz"
    link.symlink_to(tmp_path / "made.npz")
    write_atomic(link, b"data")
    assert link.is_symlink() and (tmp_path / "made.npz").read_bytes() == b"data"


@pytest.mark.parametrize("kind", ["/dev/null", "fifo", "link-to-/dev/null", "folder"])
def test_special_files_are_refused_not_replaced(tmp_path: Path, model: Path, capsys, kind) -> None:
    if kind == "fifo":
        out = tmp_path / "pipe"
        os.mkfifo(out)
    elif kind == "link-to-/dev/null":
        out = tmp_path / "null.json"
        out.symlink_to("/dev/null")
    elif kind == "folder":
        out = tmp_path / "folder"
        out.mkdir()
    else:
        out = Path(kind)
    before = os.stat(out).st_mode
    assert cli(plan_args(model, out)) == 2
    one_line(capsys, str(out), "cannot write")
    assert os.stat(out).st_mode == before and not stat.S_ISREG(before)


def test_a_bad_output_is_refused_before_the_search(tmp_path: Path, model: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ["plan", str(model), "--batch", "4", "--devices", "2", "--budget", "60"]
    began = time.monotonic()
    assert cli([*args, "-o", str(blocker / "p.json")]) == 2
    assert time.monotonic() - began < 5  # no 30-60 s search first
    one_line(capsys, "cannot write")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_folder_is_refused(tmp_path: Path, model: Path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert cli(plan_args(model, locked / "p.json")) == 2
        one_line(capsys, "not writable")
    finally:
        locked.chmod(0o700)


def test_missing_folders_are_created(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a" / "b" / "f.txt", "x")
    assert (tmp_path / "a" / "b" / "f.txt").read_text() == "x"
    assert check_output(tmp_path / "new" / "f.txt") == tmp_path / "new" / "f.txt"


@pytest.mark.parametrize("path", ["/dev/zero", "fifo", "folder", "missing", "nul\0byte"])
def test_inputs_must_be_regular_files(tmp_path: Path, path: str) -> None:
    if path == "fifo":
        os.mkfifo(tmp_path / "fifo")
    if path == "folder":
        (tmp_path / "folder").mkdir()
    with pytest.raises(UserError):
        check_input(path if path.startswith("/") else tmp_path / path, "model file")


def test_save_weights_is_checked_before_training(tmp_path: Path, model: Path) -> None:
    plan = tmp_path / "plan.json"
    assert (
        cli(
            [
                "plan",
                str(model),
                "--batch",
                "2",
                "--devices",
                "1",
                "--strategy",
                "data-parallel",
                "-o",
                str(plan),
            ]
        )
        == 0
    )
    began = time.monotonic()
    options = RunOptions(plan=plan, steps=10**6, save_weights=tmp_path)
    with pytest.raises(UserError, match="cannot write"):
        train(MPI.COMM_SELF, options)
    assert time.monotonic() - began < 5
    link = tmp_path / "w.npz"
    link.symlink_to(tmp_path / "weights-target.npz")
    train(MPI.COMM_SELF, RunOptions(plan=plan, steps=1, save_weights=link))
    assert link.is_symlink() and (tmp_path / "weights-target.npz").stat().st_size > 0
