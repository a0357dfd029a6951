"""``Strategy``: a ``ParallelConfig`` per op, checked against the graph's SOAP space."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from onnx2soap.errors import PlanError
from onnx2soap.ir import Graph
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.dims import SoapDim
from onnx2soap.soap.partition import ParallelConfig


@dataclass(frozen=True)
class Strategy:
    devices: int
    configs: Mapping[str, ParallelConfig]

    def __post_init__(self) -> None:
        object.__setattr__(self, "configs", MappingProxyType(dict(self.configs)))

    def __getitem__(self, op: str) -> ParallelConfig:
        return self.configs[op]

    def replace(self, op: str, config: ParallelConfig) -> Strategy:
        return Strategy(self.devices, {**self.configs, op: config})

    def __hash__(self) -> int:
        return hash((self.devices, tuple(sorted(self.configs.items()))))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Strategy)
            and self.devices == other.devices
            and dict(self.configs) == dict(other.configs)
        )


def validate_config(
    op: str, dims: tuple[SoapDim, ...], config: ParallelConfig, devices: int
) -> None:
    where = f"op '{op}'"
    if len(config.degrees) != len(dims):
        raise PlanError(f"{where}: {len(config.degrees)} degrees for {len(dims)} dims")
    for dim, degree in zip(dims, config.degrees, strict=True):
        if degree < 1:
            raise PlanError(f"{where}: degrees.{dim.name} must be >= 1, got {degree}")
        if degree > 1 and not dim.splittable:
            raise PlanError(
                f"{where}: degrees.{dim.name} = {degree}, but {dim.kind.value} dim "
                f"'{dim.name}' cannot be split; splittable: "
                f"{[d.name for d in dims if d.splittable] or 'none'}"
            )
        if degree > dim.max_degree:
            raise PlanError(
                f"{where}: degrees.{dim.name} = {degree} exceeds the {dim.max_degree} pieces "
                f"dim '{dim.name}' (size {dim.size}) can be cut into"
            )
    copies = config.copies
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise PlanError(f"{where}: copies must be an integer >= 1, got {copies!r}")
    need = math.prod(config.degrees) * copies
    if len(config.devices) != need:
        made = "the degrees" if copies == 1 else f"the degrees and {copies} copies"
        raise PlanError(
            f"{where}: devices has {len(config.devices)} entries; {made} make {need} tasks"
        )
    for d in config.devices:
        if not 0 <= d < devices:
            raise PlanError(f"{where}: device {d} is outside 0..{devices - 1}")
    for b in range(0, need, copies):
        box = config.devices[b : b + copies]
        if len(set(box)) < copies:
            raise PlanError(
                f"{where}: copies: a box's {copies} copies must be on distinct devices, "
                f"got {list(box)}"
            )


def validate(graph: Graph, space: Mapping[str, tuple[SoapDim, ...]], strategy: Strategy) -> None:
    if strategy.devices < 1:
        raise PlanError(f"devices must be >= 1, got {strategy.devices}")
    names = [op.name for op in graph.ops]
    missing = [n for n in names if n not in strategy.configs]
    if missing:
        raise PlanError(f"ops missing from the plan: {missing}")
    unknown = [n for n in strategy.configs if n not in space]
    if unknown:
        raise PlanError(f"ops in the plan that the model does not have: {unknown}")
    for name in names:
        validate_config(name, space[name], strategy[name], strategy.devices)
    copied = [op for op in graph.ops if strategy[op.name].copies > 1]
    if copied:
        allowed = weight_only_ops(graph)
        for op in copied:
            config = strategy[op.name]
            if op.name not in allowed:
                raise PlanError(
                    f"op '{op.name}': copies = {config.copies}, but only an op that reads "
                    "weights and constants alone (no data, labels or state, not the loss, "
                    "no random draws) may be computed more than once"
                )
            split = [
                d.name
                for d, k in zip(space[op.name], config.degrees, strict=True)
                if k > 1 and d.axis is None
            ]
            if split:
                raise PlanError(
                    f"op '{op.name}': copies = {config.copies} with split reduction dims "
                    f"{split}: partial sums cannot be copied"
                )
