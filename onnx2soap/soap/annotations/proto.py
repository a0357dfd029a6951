"""``Sharding`` to and from ``ShardingSpecProto``, every field of a read one checked.

A block held by one device is listed by its index in the configuration; a block held by
a group is listed by a key of ``index_to_device_group_map`` (negative, as the standard's
examples write them), one key per distinct group.
"""

from __future__ import annotations

import onnx

from onnx2soap.errors import PlanError
from onnx2soap.soap.annotations.sharding import Cut, Sharding, block_count

# A block count past this is no plan of at most 1,024 devices' tasks: refused before a
# list of that many blocks is made.
MAX_BLOCKS = 1 << 20


def to_proto(sharding: Sharding) -> onnx.ShardingSpecProto:
    spec = onnx.ShardingSpecProto(tensor_name=sharding.tensor)
    keys: dict[frozenset[int], int] = {}
    for holders in sharding.holders:
        if len(holders) == 1:
            spec.device.append(next(iter(holders)))
            continue
        if holders not in keys:
            keys[holders] = -1 - len(keys)
            entry = spec.index_to_device_group_map.add(key=keys[holders])
            entry.value.extend(sorted(holders))
        spec.device.append(keys[holders])
    for cut in sharding.cuts:
        dim = spec.sharded_dim.add(axis=cut.axis)
        simple = dim.simple_sharding.add(num_shards=cut.shards)
        if cut.size is not None:
            simple.dim_value = cut.size
    return spec


def from_proto(spec: onnx.ShardingSpecProto, rank: int | None, devices: int) -> Sharding:
    """The spec read and checked: ``PlanError`` naming the field (relative to the spec)
    where it is malformed, names a device past ``devices``, or cuts an axis twice
    (overlapping shards). ``rank``: the tensor's rank where known (a negative axis
    counts from its end; unknown, it is kept as written: the tensor is none of an op's)."""
    if not spec.tensor_name:
        raise PlanError("tensor_name: missing (it names the input or output sharded)")
    groups = _groups(spec, devices)
    cuts = _cuts(spec, rank)
    blocks = block_count(cuts)
    if blocks > MAX_BLOCKS:
        raise PlanError(f"sharded_dim: {blocks} blocks (at most {MAX_BLOCKS})")
    if len(spec.device) != blocks:
        raise PlanError(
            f"device: {len(spec.device)} entries, but the sharded dims make {blocks} blocks"
        )
    holders = []
    for i, key in enumerate(spec.device):
        if key in groups:
            holders.append(groups[key])
        elif 0 <= key < devices:
            holders.append(frozenset({key}))
        else:
            raise PlanError(_no_device(f"device[{i}]", key, devices))
    return Sharding(spec.tensor_name, cuts, tuple(holders))


def _no_device(field: str, device: int, devices: int) -> str:
    return (
        f"{field}: device {device} is not one of the configuration's {devices} "
        f"(0 to {devices - 1}) and no device group has that key"
    )


def _groups(spec: onnx.ShardingSpecProto, devices: int) -> dict[int, frozenset[int]]:
    groups: dict[int, frozenset[int]] = {}
    for i, entry in enumerate(spec.index_to_device_group_map):
        field = f"index_to_device_group_map[{i}]"
        if entry.key in groups:
            raise PlanError(f"{field}: key {entry.key} appears twice")
        if not entry.value:
            raise PlanError(f"{field}: the group of key {entry.key} has no devices")
        for j, d in enumerate(entry.value):
            if not 0 <= d < devices:
                raise PlanError(
                    f"{field}.value[{j}]: device {d} is not one of the configuration's "
                    f"{devices} (0 to {devices - 1})"
                )
        if len(set(entry.value)) != len(entry.value):
            raise PlanError(f"{field}: the group of key {entry.key} lists a device twice")
        groups[entry.key] = frozenset(entry.value)
    return groups


def _cuts(spec: onnx.ShardingSpecProto, rank: int | None) -> tuple[Cut, ...]:
    cuts: list[Cut] = []
    seen: dict[int, int] = {}
    for i, dim in enumerate(spec.sharded_dim):
        field = f"sharded_dim[{i}]"
        if not dim.HasField("axis"):
            raise PlanError(f"{field}.axis: missing")
        axis = dim.axis
        if rank is not None:
            if not -rank <= axis < rank:
                raise PlanError(f"{field}.axis: {axis} is outside a tensor of rank {rank}")
            axis %= rank
        if axis in seen:
            raise PlanError(
                f"{field}.axis: axis {axis} is already cut by sharded_dim[{seen[axis]}] "
                "(overlapping shards)"
            )
        seen[axis] = i
        if len(dim.simple_sharding) != 1:
            raise PlanError(
                f"{field}.simple_sharding: {len(dim.simple_sharding)} entries; one cut per "
                "axis is what SOAP splits (several describe a reshape's fused axes)"
            )
        simple = dim.simple_sharding[0]
        if simple.num_shards < 1:
            raise PlanError(f"{field}.simple_sharding[0].num_shards: must be >= 1")
        if simple.num_shards > MAX_BLOCKS:
            raise PlanError(
                f"{field}.simple_sharding[0].num_shards: {simple.num_shards} (at most {MAX_BLOCKS})"
            )
        size = simple.dim_value if simple.WhichOneof("dim") == "dim_value" else None
        cuts.append(Cut(axis, simple.num_shards, size))
    return tuple(cuts)
