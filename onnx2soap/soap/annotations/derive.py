"""An op's config from the shardings the standard gives for its tensors (a file that has
no onnx2soap metadata: another tool's, or ours with it stripped).

Degrees: each cut of the output cuts the kept dim that indexes the axis; each cut of an
input axis a dim reads one to one cuts that dim (a reduction's cut, the standard's
"parallel reduction", is a partial-sum split). Two shardings that cut one dim into
different counts are refused. Devices: each task runs on the devices that hold, in
every sharding, the block its piece lies in; the intersection must name one device.
Where the node states its layout itself (``strict``) several devices mean the node's
computation is replicated, which SOAP does not do (each piece runs once), or that its
shardings do not pin the piece down (a Conv cut along its windows and its channels
where devices repeat: the input's halo blocks have no sharding): refused. Where the
layout is inferred from the producers (an op of a node without shardings, an op with
no node), the lowest such device runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from onnx2soap.errors import PlanError
from onnx2soap.ir import Op
from onnx2soap.soap.annotations.sharding import Sharding
from onnx2soap.soap.dims import SoapDim
from onnx2soap.soap.partition import ParallelConfig, task_coords

# More tasks than this is no plan for at most 1,024 devices: refused before listing them.
MAX_TASKS = 1 << 20


@dataclass(frozen=True)
class Given:
    """A tensor's sharding (canonical) and, per cut, the dim that cuts it (None: no dim
    reads that axis one to one). ``field``: how errors name it."""

    sharding: Sharding
    dims: tuple[int | None, ...]
    field: str
    output: bool


def derive(
    op: Op,
    dims: Sequence[SoapDim],
    given: Sequence[Given],
    devices: int,
    strict: bool,
    copies: bool = False,
) -> ParallelConfig:
    """``copies``: the op is weight-only (``soap/copies.py``), so where the shardings
    leave every piece to the same number of devices, each of them computes it (a
    config with ``copies``, each box's copies in device order)."""
    degrees = _degrees(op, dims, given)
    placing = [g for g in given if all(d is not None for d in g.dims)]
    if copies and strict:
        copied = _copies(degrees, placing, devices)
        if copied is not None:
            return copied
    everyone = frozenset(range(devices))
    chosen = []
    for coord in task_coords(degrees):
        allowed = everyone
        for g in placing:
            allowed = allowed & g.sharding.holders[g.sharding.block([coord[d] for d in g.dims])]
        piece = _piece_words(dims, degrees, coord)
        if not allowed:
            fields = ", ".join(g.field for g in placing)
            raise PlanError(f"{fields}: no device holds every block {piece} reads or writes")
        if strict and len(allowed) > 1:
            raise PlanError(
                f"{_owner(placing)}: the shardings leave {piece} to each of devices "
                f"{sorted(allowed)}; SOAP runs each piece of an op on one device (a "
                "replicated computation, or a piece no sharding pins down)"
            )
        chosen.append(min(allowed))
    return ParallelConfig(tuple(degrees), tuple(chosen))


def _copies(
    degrees: Sequence[int], placing: Sequence[Given], devices: int
) -> ParallelConfig | None:
    """The config with copies where every piece is left to the same r > 1 devices."""
    if not placing:
        return None
    boxes = []
    for coord in task_coords(degrees):
        allowed = frozenset(range(devices))
        for g in placing:
            allowed = allowed & g.sharding.holders[g.sharding.block([coord[d] for d in g.dims])]
        boxes.append(sorted(allowed))
    r = len(boxes[0])
    if r < 2 or any(len(b) != r for b in boxes):
        return None
    return ParallelConfig(tuple(degrees), tuple(d for b in boxes for d in b), r)


def _owner(placing: Sequence[Given]) -> str:
    out = next((g for g in placing if g.output), None)
    return (out or placing[0]).field if placing else "sharding_spec"


def _piece_words(dims: Sequence[SoapDim], degrees: Sequence[int], coord: Sequence[int]) -> str:
    split = [f"{d.name}={c}/{g}" for d, g, c in zip(dims, degrees, coord, strict=True) if g > 1]
    return f"the piece {' '.join(split)}" if split else "the op (whole)"


def _degrees(op: Op, dims: Sequence[SoapDim], given: Sequence[Given]) -> list[int]:
    degrees = [1] * len(dims)
    said: dict[int, str] = {}
    for g in given:
        for cut, d in zip(g.sharding.cuts, g.dims, strict=True):
            if d is None:
                if g.output:
                    raise PlanError(f"{g.field}: axis {cut.axis} has size 1; it has no blocks")
                continue  # a window's or an offset's axis: no dim of its own to cut
            if d in said and degrees[d] != cut.shards:
                raise PlanError(
                    f"{g.field}: axis {cut.axis} is cut in {cut.shards}, but {said[d]} cuts "
                    f"dim '{dims[d].name}' of the same op in {degrees[d]}"
                )
            degrees[d], said[d] = cut.shards, g.field
    for d, degree in enumerate(degrees):
        if degree == 1:
            continue
        dim = dims[d]
        if not dim.splittable:
            splittable = [x.name for x in dims if x.splittable] or "none"
            raise PlanError(
                f"{said[d]}: cuts {dim.kind.value} dim '{dim.name}' of op '{op.name}', which "
                f"cannot be split; splittable: {splittable}"
            )
        if degree > dim.max_degree:
            raise PlanError(
                f"{said[d]}: cuts dim '{dim.name}' (size {dim.size}) in {degree}; at most "
                f"{dim.max_degree} blocks"
            )
    if math.prod(degrees) > MAX_TASKS:
        raise PlanError(
            f"{given[0].field}: the cuts make {math.prod(degrees)} tasks of op "
            f"'{op.name}' (at most {MAX_TASKS})"
        )
    return degrees
