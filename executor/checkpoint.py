"""Checkpoints: every rank's shards written atomically, restorable under any plan.

    DIR/LATEST               the name of the newest complete checkpoint (replaced atomically)
    DIR/step-000000120/      one checkpoint: manifest.json and one .npy per saved shard
    DIR/.tmp-step-.../       a checkpoint being written (never read; removed by the next save)

A checkpoint holds, for every weight and state tensor, the Rects the plan splits it into
(each written once, by the lowest device of its replica group), the optimizer's state
(one array per Rect and slot; under ZeRO one per shard, written by its owner) and the
step. The data position and the random streams (Dropout's bits) follow from the step and
the seed, which the manifest records with the model's and the plan's sha256. A checkpoint
appears only whole: all ranks write into a temporary folder, and rank 0 renames it into
place and then points LATEST at it, so a crash at any moment leaves the previous
checkpoint as it was.

Restoring reads, for each Rect a rank holds, the saved Rects that overlap it (memory
mapped, so a rank reads only what it needs): the same plan gets its shards back bit for
bit, and another plan (other splits, another rank count) is re-sharded from them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

from executor.buffers import local_slices
from executor.runtime import Runtime
from onnx2soap.errors import UserError
from onnx2soap.files import write_atomic
from onnx2soap.soap.partition import Rect, intersect, rect_shape

FORMAT = 1
LATEST = "LATEST"
VALUE = "value"  # an entry holding a weight's or state's values (else an optimizer slot)


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match to be resumed: the model, the batch it was trained
    at, the dtype, the seed (data and Dropout) and the optimizer's kind."""

    model_sha256: str
    batch: int
    dtype: str
    seed: int
    optimizer: str
    precision: str = "fp32"  # manifests from before mixed precision trained in fp32


@dataclass(frozen=True)
class Entry:
    tensor: str
    kind: str  # VALUE or an optimizer slot name
    rect: Rect
    file: str


@dataclass(frozen=True)
class Manifest:
    identity: RunIdentity
    plan_sha256: str
    step: int  # steps completed
    entries: tuple[Entry, ...]
    loss_scale: LossScale | None = None  # fp16's, where the run scales its loss


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scale at the checkpoint: the scale, and the good steps since
    it last changed (``executor.precision.LossScaler``)."""

    scale: float
    growth_tracker: int


def _fsync_write(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(array))
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owned_arrays(rt: Runtime) -> list[tuple[str, str, Rect, object]]:
    """(tensor, kind, rect, array) of every Rect this rank writes: the values of those
    whose replica group has this rank as its lowest device, and their optimizer state;
    under ZeRO every member writes the state of its own shard."""
    out = []
    for op in rt.graph.ops:
        for group in rt.pg.groups[op.name]:
            key = (group.weight, group.rect)
            if rt.rank not in group.devices:
                continue
            for device, rect in rt.written(group):  # ZeRO-3: every member its rows
                if device == rt.rank:
                    out.append((group.weight, VALUE, rect, rt.shards[key]))
            if group.devices[0] != rt.rank and key not in rt.zero:
                continue
            for slot, array in rt.slots.get(key, {}).items():
                out.append((group.weight, slot, rt.slot_rect(key), array))
    return out


def _agree(comm: MPI.Comm, error: str | None) -> None:
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise UserError(errors[0])


def save_checkpoint(
    comm: MPI.Comm,
    rt: Runtime,
    directory: Path,
    step: int,
    identity: RunIdentity,
    plan_sha: str,
    loss_scale: LossScale | None = None,
) -> Path:
    """Write the checkpoint after ``step`` completed steps (collective); returns its path."""
    rank, name = comm.Get_rank(), f"step-{step:09d}"
    tmp = directory / f".tmp-{name}"
    error = None
    if rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for stale in directory.glob(".tmp-step-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            error = f"{directory}: cannot write a checkpoint ({e.strerror or e})"
    _agree(comm, error)
    entries, error = [], None
    try:
        for i, (tensor, kind, rect, array) in enumerate(_owned_arrays(rt)):
            file = f"r{rank}-{i}.npy"
            _fsync_write(tmp / file, rt.device.to_host(array))
            entries.append(Entry(tensor, kind, rect, file))
    except OSError as e:
        error = f"{tmp}: cannot write a checkpoint ({e.strerror or e})"
    _agree(comm, error)
    gathered = comm.gather(entries, root=0)
    final = directory / name
    if rank == 0:
        entries = tuple(e for part in gathered for e in part)
        manifest = Manifest(identity, plan_sha, step, entries, loss_scale)
        write_atomic(tmp / "manifest.json", json.dumps({"format": FORMAT, **asdict(manifest)}))
        if final.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(directory)
        write_atomic(directory / LATEST, name + "\n")
        for old in directory.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    comm.Barrier()
    return final


def _rect(value) -> Rect:
    return tuple((int(lo), int(hi)) for lo, hi in value)


def read_manifest(directory: Path) -> tuple[Manifest, Path]:
    """The newest complete checkpoint in ``directory``; one line if there is none."""
    try:
        name = (directory / LATEST).read_text().strip()
        path = directory / name
        doc = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError as e:
        raise UserError(f"{directory}: no checkpoint (missing {e.filename})") from e
    except (OSError, ValueError) as e:
        raise UserError(f"{directory}: unreadable checkpoint manifest ({e})") from e
    try:
        if doc.get("format", FORMAT) != FORMAT:
            raise UserError(f"{path}: checkpoint format {doc['format']}, this reads {FORMAT}")
        entries = tuple(
            Entry(e["tensor"], e["kind"], _rect(e["rect"]), e["file"]) for e in doc["entries"]
        )
        identity = RunIdentity(**doc["identity"])
        scale = doc.get("loss_scale")
        loss_scale = None if scale is None else LossScale(**scale)
        manifest = Manifest(identity, doc["plan_sha256"], int(doc["step"]), entries, loss_scale)
        return manifest, path
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}/manifest.json: not a checkpoint manifest ({e})") from e


def check_identity(directory: Path, saved: RunIdentity, run: RunIdentity) -> None:
    """Refuse, in one line, a checkpoint this run cannot continue."""
    if saved.model_sha256 != run.model_sha256:
        raise UserError(
            f"{directory}: the checkpoint is of another model (sha256 {saved.model_sha256[:12]}…, "
            f"this model {run.model_sha256[:12]}…)"
        )
    for field, what in (
        ("batch", "batch"),
        ("dtype", "--dtype"),
        ("seed", "--seed"),
        ("optimizer", "--optimizer"),
        ("precision", "--precision"),
    ):
        had, has = getattr(saved, field), getattr(run, field)
        if had != has:
            raise UserError(
                f"{directory}: the checkpoint was trained with {what} {had}; this run has "
                f"{has} (resume with {what} {had})"
            )


def _assemble(path: Path, entries: list[Entry], rect: Rect, dtype) -> np.ndarray:
    """The values of ``rect`` from the saved Rects that overlap it."""
    out = np.empty(rect_shape(rect), dtype=dtype)
    covered = np.zeros(rect_shape(rect), dtype=bool)
    for entry in entries:
        common = intersect(entry.rect, rect)
        if common is None:
            continue
        saved = np.load(path / entry.file, mmap_mode="r")
        if saved.shape != rect_shape(entry.rect):
            raise UserError(f"{path / entry.file}: shape {list(saved.shape)} is not its Rect's")
        out[local_slices(common, rect)] = saved[local_slices(common, entry.rect)]
        covered[local_slices(common, rect)] = True
    if not covered.all():
        raise UserError(f"{path}: the checkpoint does not cover {list(rect)} of a tensor")
    return out


def restore(rt: Runtime, manifest: Manifest, path: Path) -> None:
    """Fill this rank's shards and optimizer state from the checkpoint (any plan)."""
    by_key: dict[tuple[str, str], list[Entry]] = {}
    for entry in manifest.entries:
        by_key.setdefault((entry.tensor, entry.kind), []).append(entry)
    try:
        for (tensor, rect), shard in rt.shards.items():
            held = rt.held_rect((tensor, rect))  # under ZeRO-3 the rank's rows only
            values = _assemble(path, by_key.get((tensor, VALUE), []), held, rt.dtype)
            rt.device.to_device(values, out=shard)
            rt.refresh_compute_copy((tensor, rect))
            owned = rt.slot_rect((tensor, rect))  # under ZeRO the rank's rows only
            for slot, array in rt.slots.get((tensor, rect), {}).items():
                state = _assemble(path, by_key.get((tensor, slot), []), owned, rt.dtype)
                rt.device.to_device(state, out=array)
    except OSError as e:
        raise UserError(f"{path}: cannot read the checkpoint ({e.strerror or e})") from e
    rt.updates = manifest.step
    rt.device.synchronize()
