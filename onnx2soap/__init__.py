"""onnx2soap: SOAP parallelization plans for ONNX models, found by simulation and search.

The Python API (docs/api.md)::

    import onnx2soap
    planned = onnx2soap.plan("model.onnx", machine="dgx-h100:2", batch=8, budget=60)
    planned.save("plan.json")
    print(onnx2soap.simulate(planned).step.step_time_s)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Each public name and its module, imported on first use: the executor's ranks import
# onnx2soap's plan file reader and should not pay for the planner's imports.
_PUBLIC = {
    "plan": "onnx2soap.api",
    "simulate": "onnx2soap.api",
    "inspect": "onnx2soap.api",
    "Planned": "onnx2soap.api",
    "Simulated": "onnx2soap.api",
    "Step": "onnx2soap.api",
    "Baseline": "onnx2soap.api",
    "Inspected": "onnx2soap.inspection",
    "UserError": "onnx2soap.errors",
    "ModelError": "onnx2soap.errors",
    "PlanError": "onnx2soap.errors",
    "MachineError": "onnx2soap.errors",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'onnx2soap' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
