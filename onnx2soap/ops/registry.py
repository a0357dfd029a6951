"""The registry: every ``OpDef`` under ``onnx2soap/ops/defs/``, found by listing that
package, so adding an op is adding one module with a ``DEFINITIONS`` tuple.

The importer asks it which definition reads a node, the executor and the tests which
kernels an op type has. Built once, then read-only.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType

from onnx import defs as onnx_defs

from onnx2soap.errors import ModelError
from onnx2soap.ops.base import OpDef

# The domain of the nodes the importer writes itself (attention fused from the chain an
# exporter wrote): ONNX ops with the semantics of the newest schema their definition reads,
# whatever opset the model imports.
FUSED_DOMAIN = "ai.onnx2soap.fused"


@dataclass(frozen=True)
class Registry:
    by_name: Mapping[str, OpDef]

    def get(self, name: str) -> OpDef:
        """The definition of ``Op.type`` ``name``."""
        found = self.by_name.get(name) if isinstance(name, str) else None
        if found is None:
            raise ModelError(f"no op definition for op type {name!r}; known: {self.listing()}")
        return found

    def onnx_ops(self) -> tuple[OpDef, ...]:
        return tuple(d for d in self.by_name.values() if d.onnx)

    def listing(self) -> str:
        return ", ".join(sorted(d.name for d in self.onnx_ops()))

    def for_node(self, op_type: str, domain: str, opset: int) -> OpDef | None:
        """The definition that reads a node of ``op_type`` at the model's ``opset``, or
        None if there is none (unsupported op, or a schema version it does not read)."""
        found = self.by_name.get(op_type)
        if found is not None and found.onnx and domain == FUSED_DOMAIN:
            return found
        if found is None or not found.onnx or (domain or "") not in ("", "ai.onnx"):
            return None
        return found if schema_version(op_type, opset) in found.versions else None


def schema_version(op_type: str, opset: int) -> int | None:
    """The ``since_version`` of the schema in force for ``op_type`` at ``opset``."""
    try:
        return onnx_defs.get_schema(op_type, opset).since_version
    except onnx_defs.SchemaError:
        return None


def _discover() -> dict[str, OpDef]:
    from onnx2soap.ops import defs as package

    found: dict[str, OpDef] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for definition in getattr(module, "DEFINITIONS", ()):
            if definition.name in found:
                raise RuntimeError(f"op {definition.name} is defined twice (in {info.name})")
            found[definition.name] = definition
    return found


@cache
def registry() -> Registry:
    return Registry(MappingProxyType(_discover()))


def definition(name: str) -> OpDef:
    return registry().get(name)
