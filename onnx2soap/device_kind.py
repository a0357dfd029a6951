"""The kinds of device a rank computes on.

One enum for the two products: the executor's ``--device`` and the device a cost
database's timings were taken on (``sim/costdb.py``'s fingerprints), so that timings
are told apart by the same names the executor runs under. It lives below both (the
simulator must not import the executor).
"""

from __future__ import annotations

from enum import Enum


class DeviceKind(Enum):
    CPU = "cpu"
    CUDA = "cuda"
