"""``onnx2soap plan MODEL``: write a plan file."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnx2soap.cli.common import add_model_options, loss_choice
from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import Rule, by_rule
from onnx2soap.soap import Plan, analyze, plan_ops, save_plan, validate


def register(sub) -> None:
    p = sub.add_parser("plan", help="write a plan file for a model")
    add_model_options(p)
    p.add_argument("--devices", type=int, required=True, help="number of devices (MPI ranks)")
    p.add_argument(
        "--strategy",
        choices=[r.value for r in Rule],
        default=Rule.DATA_PARALLEL.value,
        help="rule that builds the plan (default: data-parallel)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for --strategy random")
    p.add_argument("-o", "--output", required=True, help="plan file to write")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.devices < 1:
        raise UserError(f"--devices must be >= 1, got {args.devices}")
    model = load_model(args.model, args.batch, loss_choice(args.loss))
    graph = model.graph
    if graph.loss_op is None:
        raise UserError(
            f"{args.model}: the model has no loss to train with (--loss none); "
            "choose --loss cross-entropy or mse"
        )
    space = analyze(graph)
    strategy = by_rule(Rule(args.strategy), graph, space, args.devices, args.seed)
    validate(graph, space, strategy)
    plan = Plan(
        model_path=Path(args.model),
        model_sha256=model.sha256,
        batch=graph.batch,
        loss=graph.loss,
        devices=args.devices,
        ops=plan_ops(strategy, graph, space),
    )
    save_plan(plan, args.output)
    print(f"wrote {args.output}: {args.strategy} plan for {args.devices} devices")
    return 0
