"""``onnx2soap annotate PLAN -o OUT.onnx``: the plan's model with the plan as ONNX
multi-device annotations (soap/annotations); also ``plan --annotate``. And reading a
plan from either kind of file: a JSON plan, or an annotated model (ours or another
tool's), for ``simulate``, ``compare``, ``show`` and ``plan --start``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx

from onnx2soap.errors import UserError
from onnx2soap.files import check_output
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.sim.planned import read_plan  # noqa: F401 (simulate, start read it here)
from onnx2soap.soap import Plan, analyze, import_loss, load_plan
from onnx2soap.soap.annotations import (
    annotate,
    is_annotated_model,
    load_proto,
    refer_to_data,
    write_annotated,
)


def register(sub) -> None:
    p = sub.add_parser(
        "annotate", help="write a plan's model with the plan as ONNX multi-device annotations"
    )
    p.add_argument("plan", help="plan file")
    p.add_argument("--model", help="model file (default: the plan's)")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="annotated model to write (.onnx), in the folder of the model's external data",
    )
    p.set_defaults(run=run)


def check_annotated_output(path: Path | str) -> Path:
    """An annotated model's path, checked before any work."""
    if not is_annotated_model(path):
        raise UserError(f"{path}: an annotated model is an ONNX file; name it *.onnx")
    return check_output(path)


def annotated(plan: Plan, model: Path, graph: Graph, output: Path) -> onnx.ModelProto:
    """``model`` (the plan's, at ``plan.graph_batch`` as ``graph``) annotated with
    ``plan``, its external data referred to from ``output``'s folder: made in full
    before anything is written."""
    proto = load_proto(model)
    made = annotate(proto, plan, graph, analyze(graph), output.parent)
    refer_to_data(made, model, output)
    return made


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    check_annotated_output(output)
    plan = load_plan(args.plan)
    model = Path(args.model or plan.model_path)
    imported = load_model(model, plan.graph_batch, import_loss(plan))
    if imported.sha256 != plan.model_sha256:
        raise UserError(f"{model}: not the model the plan was made for (sha256 differs)")
    write_annotated(annotated(plan, model, imported.graph, output), output)
    print(f"wrote {output}: {args.plan} as ONNX multi-device annotations")
    return 0
