"""``onnx2soap inspect MODEL``: ops, shapes, SOAP dims with kinds, FLOPs, parameters."""

from __future__ import annotations

import argparse
import json

from onnx2soap.cli.common import add_model_options, human, loss_choice
from onnx2soap.inspection import inspect_graph, inspect_model, synced
from onnx2soap.ir import Graph
from onnx2soap.soap import DimKind, SoapDim, analyze


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show the ops and their parallelizable dims")
    add_model_options(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def report(graph: Graph, model: str) -> dict:
    """``inspect --json``'s document of ``graph`` (read from ``model``)."""
    return inspect_graph(graph, model).document()


_KIND_LETTER = {
    DimKind.SAMPLE: "S",
    DimKind.ATTRIBUTE: "A",
    DimKind.PARAMETER: "P",
    DimKind.REDUCTION: "R",
}


def _dim_text(d: SoapDim, synced: bool) -> str:
    mark = ("" if d.splittable else "-") + ("*" if synced else "")
    return f"{d.name}={d.size}:{_KIND_LETTER[d.kind]}{mark}"


def table(doc: dict, graph: Graph) -> str:
    space = analyze(graph)
    legend = "dims (S/A/P/R; - = not splittable; * = statistics synchronized)"
    rows = [("op", "type", "output", legend, "FLOPs", "params")]
    for op, entry in zip(graph.ops, doc["ops"], strict=True):
        rows.append(
            (
                op.name,
                op.type,
                "x".join(map(str, entry["output_shape"])) or "scalar",
                " ".join(_dim_text(d, d.name in synced(op)) for d in space[op.name]),
                human(entry["flops"]),
                human(entry["params"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    total_flops = sum(o["flops"] for o in doc["ops"])
    total_params = sum(o["params"] for o in doc["ops"])
    lines.append(
        f"{len(graph.ops)} ops, batch {graph.batch}, loss {graph.loss.value}: "
        f"{human(total_flops)} forward FLOPs, {human(total_params)} parameters"
    )
    scalars = sorted(t.name for t in graph.constants if not t.shape)
    if scalars:
        # A 0-d float initializer is read as a constant: say so, in case one was meant to
        # be trained (a learned temperature would otherwise stay frozen without a word).
        shown = ", ".join(scalars[:8]) + (
            f" and {len(scalars) - 8} more" if len(scalars) > 8 else ""
        )
        lines.append(f"scalar constants (never trained): {shown}")
    return "\n".join(lines)


def copy_lines(copies) -> list[str]:
    """One warning per pair of weights that are copies: a tie the exporter broke."""
    return [
        f"warning: weights '{c.first}' and '{c.second}' are {c.kind.value} copies: if the "
        "model ties them, the export broke the tie and they will train apart (export with "
        "the legacy exporter, or dynamo with optimize=False)"
        for c in copies
    ]


def run(args: argparse.Namespace) -> int:
    inspected = inspect_model(args.model, args.batch, loss_choice(args.loss))
    doc = inspected.document()
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join([table(doc, inspected.graph), *copy_lines(inspected.weight_copies)]))
    return 0
