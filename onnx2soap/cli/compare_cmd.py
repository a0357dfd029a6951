"""``onnx2soap compare PLAN MEASURED``: the simulator's step next to the executor's trace.

MEASURED is what ``python -m executor run PLAN --trace MEASURED`` wrote. The plan is
simulated exactly as ``simulate`` does (same machine and costs choice); per op and phase,
the predicted and the measured compute time; the step (predicted makespan against the
median measured step) and every rank's peak memory. A pipeline plan: an op's predicted
time is its microbatches' passes, its update once, the step the schedule's
(``sim/pipeline_price.py``); ``-o`` (both timelines) is refused, as there is no
whole-step timeline of a pipeline to show yet.
"""

from __future__ import annotations

import argparse
import json

from onnx2soap.cli.common import seconds
from onnx2soap.cli.picture_options import MAX_DPI, MIN_DPI, pixels
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
from onnx2soap.sim.compare import (
    Comparison,
    Predicted,
    RankTime,
    check_same_plan,
    combined_trace,
    compare,
    read_measured,
    rings_of,
)
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.sim.simulate import simulate
from onnx2soap.viz import require_matplotlib


def register(sub) -> None:
    p = sub.add_parser("compare", help="a plan's simulated step next to its measured trace")
    p.add_argument("plan", help="plan file")
    p.add_argument("measured", help="trace written by python -m executor run PLAN --trace")
    p.add_argument("--machine", help="preset or machine file (default: the plan's, else cpu:N)")
    p.add_argument("--model", help="model file (default: the plan's)")
    add_costs_option(p)
    p.add_argument(
        "--optimizer",
        choices=list(OPTIMIZER_SLOTS),
        default="sgd",
        help="the optimizer the run trained with: its state counts in device memory",
    )
    p.add_argument("-o", "--output", help="write both timelines to one Perfetto JSON file")
    p.add_argument("--chart", help="write a PNG of predicted and measured time per op")
    p.add_argument(
        "--size",
        type=pixels,
        default=(1200, 900),
        metavar="WxH",
        help="chart size in pixels (default 1200x900)",
    )
    p.add_argument(
        "--dpi",
        type=int_in(MIN_DPI, MAX_DPI),
        default=100,
        help="chart dots per inch (default 100)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.chart:
        require_matplotlib()
    _check_outputs(args)  # before the work, not after it
    if args.output:  # one microbatch's timeline next to the measured step: not done yet
        refuse_pipeline(plan_on_machine(args), "-o")
    measured = read_measured(args.measured)
    predicted, memory, costs = _simulate(args)
    check_same_plan(predicted, measured, args.measured)
    comparison = compare(predicted, measured, memory)
    if args.output:
        write_atomic(args.output, json.dumps(combined_trace(predicted, measured, comparison)))
    if args.chart:
        from onnx2soap.viz.compare_chart import render_comparison
        from onnx2soap.viz.render import Size

        size = Size(args.size[0], args.size[1], args.dpi)
        write_atomic(args.chart, render_comparison(comparison, size, args.plan))
    if args.json:
        print(json.dumps(_document(comparison, predicted, costs)))
    else:
        _print(args, comparison, predicted, costs)
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    targets = [check_output(p).resolve() for p in (args.output, args.chart) if p]
    if len(set(targets)) < len(targets):
        raise UserError(f"{args.chart}: --chart must be another file than -o")


def _simulate(args: argparse.Namespace) -> tuple[Predicted, tuple[int, ...], str]:
    """The plan simulated as ``simulate`` simulates it (same checks, machine, costs)."""
    planned = plan_on_machine(args)
    machine = planned.machine
    costs = choose_costs(planned.spec, machine, args.costs)
    pg = partitioned(args, planned)
    costs = step_costs(costs, planned, pg)
    simulator = plan_simulator(planned, costs.model, OPTIMIZER_SLOTS[args.optimizer])
    ev = simulator.evaluate(pg)
    tg = simulator.task_graph(pg, names=True)
    # a pipeline plan: its microbatches' passes, its step the schedule's
    step = ev.step_time_s if ev.pipeline else None
    predicted = Predicted(tg, simulate(tg), machine, simulator.repeats(pg), step, rings_of(pg))
    return predicted, ev.peak_memory_bytes, costs.description


def _document(c: Comparison, predicted: Predicted, costs: str) -> dict:
    return {
        "ops": [
            {"op": r.op, "phase": r.phase, "predicted_s": r.predicted_s, "measured_s": r.measured_s}
            for r in c.rows
        ],
        "step": {
            "predicted_s": c.predicted_step_s,
            "measured_s": c.measured_step_s,
            "measured_steps_s": list(c.measured_steps_s),
        },
        "memory": {
            "predicted_bytes": list(c.predicted_memory),
            "measured_bytes": list(c.measured_memory),
        },
        "ranks": [
            {"rank": p.rank, "predicted": _parts(p), "measured": _parts(m)}
            for p, m in zip(c.predicted_ranks, c.measured_ranks, strict=True)
        ],
        "machine": predicted.machine.name,
        "costs": costs,
    }


def _parts(t: RankTime) -> dict:
    return {
        "compute_s": t.compute_s,
        "messages_s": t.messages_s,
        "waiting_s": t.waiting_s,
        "between_s": t.between_s,
    }


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.2f}" if predicted > 0 else "-"


def _print(args: argparse.Namespace, c: Comparison, predicted: Predicted, costs: str) -> None:
    steps = len(c.measured_steps_s)
    print(f"{args.plan} on {predicted.machine.name}, against {args.measured} ({steps} steps)")
    print(f"  costs {costs}")
    width = max([len(f"{r.op} {r.phase}") for r in c.rows] + [10])
    print(f"  {'op':<{width}}  {'predicted':>12}  {'measured':>12}  {'meas/pred':>9}")
    for r in c.rows:
        label = f"{r.op} {r.phase}"
        print(
            f"  {label:<{width}}  {r.predicted_s * 1e3:>9.3f} ms  {r.measured_s * 1e3:>9.3f} ms"
            f"  {_ratio(r.measured_s, r.predicted_s):>9}"
        )
    pred = sum(r.predicted_s for r in c.rows)
    meas = sum(r.measured_s for r in c.rows)
    print(
        f"  {'compute, all ops':<{width}}  {pred * 1e3:>9.3f} ms  {meas * 1e3:>9.3f} ms"
        f"  {_ratio(meas, pred):>9}"
    )
    print(
        f"  step: predicted {seconds(c.predicted_step_s)}, measured {seconds(c.measured_step_s)} "
        f"(median of {steps}; {seconds(min(c.measured_steps_s))} to "
        f"{seconds(max(c.measured_steps_s))}), measured/predicted "
        f"{_ratio(c.measured_step_s, c.predicted_step_s)}"
    )
    _print_ranks(c)
    for d, (p, m) in enumerate(zip(c.predicted_memory, c.measured_memory, strict=True)):
        error = f"{(p - m) / m * 100:+.1f} %" if m else "-"
        print(
            f"  device {d:<3} peak memory predicted {p / 2**20:.2f} MiB, "
            f"measured {m / 2**20:.2f} MiB ({error})"
        )
    if args.output:
        print(f"  both timelines written to {args.output} (open in ui.perfetto.dev)")
    if args.chart:
        print(f"  chart written to {args.chart}")


def _print_ranks(c: Comparison) -> None:
    """Where each rank's step went, predicted / measured (medians over the steps)."""
    heads = ("compute", "messages", "waiting", "between instructions")
    print("  per rank, predicted / measured, ms (medians over the steps):")
    print("  rank  " + "".join(f"{h:<22}" for h in heads).rstrip())
    for p, m in zip(c.predicted_ranks, c.measured_ranks, strict=True):
        cells = [
            f"{a * 1e3:.3f} / {b * 1e3:.3f}"
            for a, b in (
                (p.compute_s, m.compute_s),
                (p.messages_s, m.messages_s),
                (p.waiting_s, m.waiting_s),
            )
        ]
        cells.append(f"- / {m.between_s * 1e3:.3f}")
        print(f"  {p.rank:<4}  " + "".join(f"{x:<22}" for x in cells).rstrip())
