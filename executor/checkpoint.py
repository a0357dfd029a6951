"""Checkpoints: every rank's shards written atomically, restorable under any plan.

    DIR/LATEST               the name of the newest complete checkpoint (replaced atomically)
    DIR/step-000000120/      one checkpoint: safetensors shards and their index
                             (``checkpoint_files``; format 1, .npy files and a manifest,
                             is still read: ``checkpoint_v1``)
    DIR/.tmp-step-.../       a checkpoint being written (never read; removed by the next save)

A checkpoint holds, for every weight and state tensor, the Rects the plan splits it into
(each written once, by the lowest device of its replica group; under ZeRO-3 every member
its rows), the optimizer's state (one array per Rect and slot; under ZeRO one per shard,
written by its owner) and the step. Each rank writes what it holds into its own files.
The data position and the random streams (Dropout's bits) follow from the step and the
seed, which the index records with the model's and the plan's sha256. A checkpoint
appears only whole: all ranks write into a temporary folder, rank 0 writes the index
last, renames the folder into place and then points LATEST at it, so a crash at any
moment leaves the previous checkpoint as it was.

Restoring reads, for each Rect a rank holds, the boxes of the saved Rects that overlap
it (nothing else): the same plan gets its shards back bit for bit, and another plan
(other splits, another rank count) is re-sharded from them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from mpi4py import MPI

from executor import checkpoint_v1
from executor.buffers import local_slices
from executor.checkpoint_files import (
    INDEX,
    load_index,
    rank_file,
    shard_key,
    stored_shards,
    write_shard_file,
)
from executor.runtime import Runtime
from onnx2soap.errors import UserError
from onnx2soap.files import write_atomic
from onnx2soap.importer.weights import StoredTensor
from onnx2soap.soap.partition import Rect, intersect, rect_shape

FORMAT = 2
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
    stored: StoredTensor | None = None  # its place in a safetensors file (None: a .npy)


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owned_arrays(rt: Runtime) -> dict[str, dict[str, object]]:
    """This rank's arrays to write, by file kind (``model``, ``optimizer``) and key: the
    values of the Rects whose replica group has this rank as its lowest device, and
    their optimizer state; under ZeRO every member writes the state of its own shard."""
    values, slots = {}, {}
    for op in rt.graph.ops:
        for group in rt.pg.groups[op.name]:
            key = (group.weight, group.rect)
            if rt.rank not in group.devices:
                continue
            for device, rect in rt.written(group):  # ZeRO-3: every member its rows
                if device == rt.rank:
                    values[shard_key(group.weight, rect)] = rt.shards[key]
            if group.devices[0] != rt.rank and key not in rt.zero:
                continue
            for slot, array in rt.slots.get(key, {}).items():
                slots[shard_key(group.weight, rt.slot_rect(key), slot)] = array
    return {"model": values, "optimizer": slots}


def _agree(comm: MPI.Comm, error: str | None) -> None:
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise UserError(errors[0])


def _write_rank_files(rt: Runtime, tmp: Path, rank: int) -> tuple[dict, dict, int]:
    """This rank's files (none where it holds nothing): the index's part of its maps,
    and the bytes written."""
    maps, total = {"model": {}, "optimizer": {}}, 0
    for kind, arrays in _owned_arrays(rt).items():
        if arrays:
            file = rank_file(kind, rank)
            total += write_shard_file(tmp / file, arrays.items(), rt.device.to_host, rt.dtype)
            maps[kind] = dict.fromkeys(arrays, file)
    if any(maps.values()):
        _fsync_dir(tmp)
    return maps["model"], maps["optimizer"], total


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
    rank = comm.Get_rank()
    tmp = directory / f".tmp-step-{step:09d}"
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
    part, error = ({}, {}, 0), None
    try:
        part = _write_rank_files(rt, tmp, rank)
    except OSError as e:
        error = f"{tmp}: cannot write a checkpoint ({e.strerror or e})"
    _agree(comm, error)
    parts = comm.gather(part, root=0)
    name, error = None, None
    if rank == 0:
        metadata = _metadata(comm, step, identity, plan_sha, loss_scale)
        try:
            name = _publish(directory, tmp, step, metadata, parts)
        except UserError as e:
            error = str(e)
        except OSError as e:
            error = f"{directory}: cannot write a checkpoint ({e.strerror or e})"
    name, error = comm.bcast((name, error), root=0)
    if error:
        raise UserError(error)
    return directory / name


def _metadata(
    comm: MPI.Comm, step: int, identity: RunIdentity, plan_sha: str, scale: LossScale | None
) -> dict:
    """What the index records beside its maps: what the run must match, and where it was."""
    return {
        "format": "onnx2soap-checkpoint",
        "version": FORMAT,
        "step": step,
        "identity": asdict(identity),
        "plan_sha256": plan_sha,
        "ranks": comm.Get_size(),
        "loss_scale": None if scale is None else asdict(scale),
    }


def _publish(directory: Path, tmp: Path, step: int, metadata: dict, parts: list) -> str:
    """Rank 0, once every rank's files are synced: the index, the rename, LATEST, and
    the older checkpoints removed. Returns the checkpoint's name."""
    weight_map = {k: f for part in parts for k, f in part[0].items()}
    optimizer_map = {k: f for part in parts for k, f in part[1].items()}
    metadata = {"total_size": sum(part[2] for part in parts), **metadata}
    index = {"metadata": metadata, "weight_map": weight_map, "optimizer_map": optimizer_map}
    write_atomic(tmp / INDEX, json.dumps(index, indent=1))
    _fsync_dir(tmp)
    # A fresh name: LATEST may name a checkpoint of this very step (a run started over),
    # which must stay whole until LATEST names the new one.
    name, again = f"step-{step:09d}", 1
    while (directory / name).exists():
        name, again = f"step-{step:09d}.{again}", again + 1
    os.rename(tmp, directory / name)
    _fsync_dir(directory)
    write_atomic(directory / LATEST, name + "\n")
    for old in directory.glob("step-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return name


def read_manifest(directory: Path) -> tuple[Manifest, Path]:
    """The newest complete checkpoint in ``directory`` (every file it names checked
    against its header); one line naming the file and the field if it cannot be read."""
    try:
        name = (directory / LATEST).read_text().strip()
    except FileNotFoundError as e:
        raise UserError(f"{directory}: no checkpoint (missing {e.filename})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{directory / LATEST}: cannot read ({e})") from e
    path = directory / name
    if "/" in name or not name.startswith("step-") or not path.is_dir():
        raise UserError(f"{directory / LATEST}: names {name!r}, which is not a checkpoint here")
    if (path / INDEX).is_file():
        return _read_index(path), path
    if (path / checkpoint_v1.MANIFEST).is_file():
        doc, entries = checkpoint_v1.load_manifest(path)
        manifest = _fields(doc, path / checkpoint_v1.MANIFEST)
        return replace(manifest, entries=tuple(Entry(*e) for e in entries)), path
    raise UserError(f"{directory}: no checkpoint (missing {path / INDEX})")


def _read_index(path: Path) -> Manifest:
    doc = load_index(path)
    where = path / INDEX
    version = doc["metadata"].get("version")
    if version != FORMAT:
        raise UserError(
            f"{where}: metadata field 'version' is {version!r}; this reads checkpoints of "
            f"format {checkpoint_v1.VERSION} and {FORMAT}"
        )
    manifest = _fields(doc["metadata"], where)
    try:
        elem_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(manifest.identity.dtype))
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"{where}: metadata field 'identity.dtype' is not a dtype") from e
    entries = tuple(
        Entry(s.tensor, VALUE if s.slot is None else s.slot, s.rect, s.file, s.where)
        for s in stored_shards(path, doc, elem_type)
    )
    return replace(manifest, entries=entries)


def _fields(doc: Mapping, where: Path) -> Manifest:
    """The step, identity, plan and loss scale a checkpoint's metadata records."""
    try:
        identity = RunIdentity(**doc["identity"])
        scale = doc.get("loss_scale")
        loss_scale = None if scale is None else LossScale(**scale)
        step = doc["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"field 'step' is {step!r}, not a count of steps")
        return Manifest(identity, str(doc["plan_sha256"]), step, (), loss_scale)
    except KeyError as e:
        raise UserError(f"{where}: no field {e} in the checkpoint's metadata") from e
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: not a checkpoint's metadata ({e})") from e


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


def _read_box(path: Path, entry: Entry, box: Rect) -> np.ndarray:
    """``box`` (inside the entry's Rect) of a saved Rect, read alone."""
    if entry.stored is None:
        return checkpoint_v1.read_npy_box(path / entry.file, entry.rect, box)
    local = tuple((lo - at, hi - at) for (lo, hi), (at, _) in zip(box, entry.rect, strict=True))
    return entry.stored.read(local)


def _assemble(path: Path, entries: list[Entry], rect: Rect, dtype, what: str) -> np.ndarray:
    """The values of ``rect`` of ``what`` (a tensor, or its slot) from the saved Rects
    that overlap it."""
    out = np.empty(rect_shape(rect), dtype=dtype)
    covered = np.zeros(rect_shape(rect), dtype=bool)
    for entry in entries:
        if len(entry.rect) != len(rect):
            raise UserError(
                f"{path / entry.file}: {what} is saved with {len(entry.rect)} axes; the "
                f"model's has {len(rect)}"
            )
        common = intersect(entry.rect, rect)
        if common is None:
            continue
        out[local_slices(common, rect)] = _read_box(path, entry, common)
        covered[local_slices(common, rect)] = True
    if not covered.all():
        raise UserError(f"{path}: no saved shard holds all of {list(rect)} of {what}")
    return out


def restore(rt: Runtime, manifest: Manifest, path: Path) -> None:
    """Fill this rank's shards and optimizer state from the checkpoint (any plan)."""
    by_key: dict[tuple[str, str], list[Entry]] = {}
    for entry in manifest.entries:
        by_key.setdefault((entry.tensor, entry.kind), []).append(entry)
    try:
        for (tensor, rect), shard in rt.shards.items():
            held = rt.held_rect((tensor, rect))  # under ZeRO-3 the rank's rows only
            saved = by_key.get((tensor, VALUE), [])
            values = _assemble(path, saved, held, rt.dtype, repr(tensor))
            rt.device.to_device(values, out=shard)
            rt.refresh_compute_copy((tensor, rect))
            owned = rt.slot_rect((tensor, rect))  # under ZeRO the rank's rows only
            for slot, array in rt.slots.get((tensor, rect), {}).items():
                saved = by_key.get((tensor, slot), [])
                state = _assemble(path, saved, owned, rt.dtype, f"{slot} of {tensor!r}")
                rt.device.to_device(state, out=array)
    except OSError as e:
        raise UserError(f"{path}: cannot read the checkpoint ({e.strerror or e})") from e
    rt.updates = manifest.step
    rt.device.synchronize()
