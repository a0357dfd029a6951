"""``onnx2soap show PLAN -o plan.png``: the plan as a picture, and its simulated step.

The picture has two panels: the plan grid (ops in graph order against devices, a cell per
task coloured by its split, transfers as thin lines) and the Gantt chart of one simulated
step (a row per device and per link used, bars coloured by task kind). ``--gantt PATH``
writes the Gantt chart to a file of its own instead, leaving the grid alone in ``-o``.
"""

from __future__ import annotations

import argparse

from onnx2soap.cli.common import seconds
from onnx2soap.cli.picture_options import add_picture_options, picture_size
from onnx2soap.cli.profile_cmd import add_costs_option, choose_costs
from onnx2soap.cli.simulate_cmd import (
    partitioned,
    plan_on_machine,
    plan_simulator,
    refuse_pipeline,
    step_costs,
)
from onnx2soap.errors import UserError
from onnx2soap.files import check_output, write_atomic
from onnx2soap.options import int_in
from onnx2soap.sim import Simulator
from onnx2soap.sim.simulate import simulate
from onnx2soap.soap import PartitionedGraph, analyze
from onnx2soap.viz import require_matplotlib
from onnx2soap.viz.layout import MAX_TRANSFERS, gantt_chart, plan_grid


def register(sub) -> None:
    p = sub.add_parser("show", help="draw a plan and its simulated step as a PNG")
    p.add_argument("plan", help="plan file")
    add_picture_options(p, default=(1600, 1000))
    p.add_argument("--gantt", help="write the Gantt chart to this PNG instead of below the grid")
    p.add_argument("--machine", help="preset or machine file (default: the plan's, else cpu:N)")
    p.add_argument("--model", help="model file (default: the plan's)")
    p.add_argument(
        "--max-transfers",
        type=int_in(0, 100_000),
        default=MAX_TRANSFERS,
        help=f"draw at most this many transfer lines (default {MAX_TRANSFERS})",
    )
    add_costs_option(p)  # what plan and simulate priced the plan with, unless told
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require_matplotlib()
    _check_outputs(args)
    from onnx2soap.viz.render import render_gantt, render_plan

    pg, simulator = _load(args)
    space = analyze(pg.graph)
    grid = plan_grid(pg, space, args.max_transfers)
    if simulator.pipeline is not None:  # the grid alone: no whole-step timeline yet
        return _pipeline_grid(args, grid, simulator.evaluate(pg).step_time_s, simulator)
    tg = simulator.task_graph(pg, names=True)
    gantt = gantt_chart(tg, simulate(tg), simulator.machine)
    size = picture_size(args)
    zero = f", {simulator.zero.label}" if simulator.zero else ""
    title = (
        f"{args.plan}: {len(grid.cells)} tasks of {len(grid.ops)} ops on {grid.devices} "
        f"devices ({simulator.machine.name}, step {seconds(gantt.makespan)}{zero})"
    )
    step = f"simulated step ({seconds(gantt.makespan)})"
    if args.gantt:
        write_atomic(args.output, render_plan(grid, None, size, title).png)
        write_atomic(args.gantt, render_gantt(gantt, size).png)
        print(f"{args.output}: plan grid; {args.gantt}: {step}")
    else:
        write_atomic(args.output, render_plan(grid, gantt, size, title).png)
        print(f"{args.output}: plan grid and {step}")
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Before the work, not after it; two panels cannot both land in one file."""
    target = check_output(args.output)
    if args.gantt and check_output(args.gantt).resolve() == target.resolve():
        raise UserError(f"{args.gantt}: --gantt must be another file than -o")


def _load(args: argparse.Namespace) -> tuple[PartitionedGraph, Simulator]:
    """The plan partitioned on its model and its simulator, as ``simulate`` makes them
    (same checks, the same costs: a profiled DB beside the machine file and its
    calibration, where ``plan`` priced with them; the roofline drew the demo's plan at
    12.15 ms where ``plan`` had printed 9.66)."""
    planned = plan_on_machine(args)
    if args.gantt:
        refuse_pipeline(planned, "--gantt")
    costs = choose_costs(planned.spec, planned.machine, args.costs)
    pg = partitioned(args, planned)
    costs = step_costs(costs, planned, pg)
    return pg, plan_simulator(planned, costs.model, 0)


def _pipeline_grid(args: argparse.Namespace, grid, step: float, simulator: Simulator) -> int:
    """A pipeline plan: its grid (one microbatch's split), titled with the step."""
    from onnx2soap.viz.render import render_plan

    pipe = simulator.pipeline
    title = (
        f"{args.plan}: {len(grid.cells)} tasks of {len(grid.ops)} ops on {grid.devices} "
        f"devices, {len(pipe.stages)} stages x {pipe.microbatches} microbatches "
        f"({pipe.schedule.value}; {simulator.machine.name}, step {seconds(step)})"
    )
    write_atomic(args.output, render_plan(grid, None, picture_size(args), title).png)
    print(f"{args.output}: plan grid (a pipeline's Gantt chart is not drawn yet)")
    return 0
