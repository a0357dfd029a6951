"""Op definitions: one module per op (or small family) under ``defs/``, found by the
registry. See ``base.OpDef`` for what a definition holds.

    from onnx2soap.ops import definition, registry
    definition(op.type).forward(xp, op.attrs, buffers, TaskArgs(...))
"""

from onnx2soap.ops.base import Case, OpDef, TaskArgs
from onnx2soap.ops.registry import Registry, definition, registry

__all__ = ["Case", "OpDef", "Registry", "TaskArgs", "definition", "registry"]
