"""Checkpoints of format 1 (before safetensors), read so that a run checkpointed by an
older onnx2soap still resumes: ``manifest.json`` (the step, the run's identity and one
entry per saved Rect: tensor, kind, rect, file) and one .npy per Rect. Never written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from executor.buffers import local_slices
from onnx2soap.errors import UserError
from onnx2soap.soap.partition import Rect, rect_shape

MANIFEST = "manifest.json"
VERSION = 1


def load_manifest(path: Path) -> tuple[dict, list[tuple[str, str, Rect, str]]]:
    """The manifest's fields and its entries (tensor, kind, rect, file)."""
    manifest = path / MANIFEST
    try:
        doc = json.loads(manifest.read_text())
    except OSError as e:
        raise UserError(f"{manifest}: cannot read ({e.strerror or e})") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{manifest}: not a checkpoint manifest ({e})") from e
    try:
        if doc.get("format", VERSION) != VERSION:
            raise UserError(f"{manifest}: checkpoint format {doc['format']}, this reads {VERSION}")
        entries = [
            (e["tensor"], e["kind"], tuple((int(lo), int(hi)) for lo, hi in e["rect"]), e["file"])
            for e in doc["entries"]
        ]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{manifest}: not a checkpoint manifest ({e})") from e
    return doc, entries


def read_npy_box(file: Path, rect: Rect, box: Rect) -> np.ndarray:
    """``box`` (inside ``rect``) of the .npy holding ``rect`` (memory-mapped: read no more)."""
    try:
        saved = np.load(file, mmap_mode="r")
    except ValueError as e:
        raise UserError(f"{file}: not a .npy array ({e})") from e
    if saved.shape != rect_shape(rect):
        raise UserError(f"{file}: shape {list(saved.shape)} is not its Rect's")
    return np.asarray(saved[local_slices(box, rect)])
