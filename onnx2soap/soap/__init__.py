"""The SOAP space: dims and kinds, configs and strategies, the partition math, plan files.

Public surface:
    analyze(graph) -> {op: (SoapDim, ...)}      kinds and splittability per op
    ParallelConfig, Strategy, validate          one config per op
    Partitioner(graph).partition(strategy)      tasks, overlaps, weight replica groups
    candidates(dims, devices)                   the search's moves
    Plan, load_plan, save_plan                  the plan file
"""

from onnx2soap.soap.candidates import candidates
from onnx2soap.soap.dims import DimKind, SoapDim, analyze
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.partitioned import Edge, PartitionedGraph, Partitioner
from onnx2soap.soap.plan import (
    OpPlan,
    Plan,
    Predicted,
    SearchInfo,
    import_loss,
    load_plan,
    plan_ops,
    save_plan,
)
from onnx2soap.soap.strategy import Strategy, validate

__all__ = [
    "DimKind",
    "Edge",
    "OpPlan",
    "ParallelConfig",
    "PartitionedGraph",
    "Partitioner",
    "Plan",
    "Predicted",
    "SearchInfo",
    "SoapDim",
    "Strategy",
    "analyze",
    "candidates",
    "import_loss",
    "load_plan",
    "plan_ops",
    "save_plan",
    "validate",
]
