"""``onnx2soap simulate PLAN``: predicted step time, memory and traffic of a plan (a plan
file, or a model with ONNX multi-device annotations)."""

from __future__ import annotations

import argparse
import json

from onnx2soap.cli.common import gib, seconds
from onnx2soap.cli.profile_cmd import add_costs_option
from onnx2soap.errors import UserError
from onnx2soap.files import check_output
from onnx2soap.options import int_in
from onnx2soap.sim import Evaluation
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.sim.planned import (  # noqa: F401 (compare and show import these from here)
    PlanOnMachine,
    model_sha256,
    partition,
    place,
    plan_simulator,
    price,
    read_plan,
    step_costs,
)
from onnx2soap.sim.simulate import simulate
from onnx2soap.sim.trace import write_trace
from onnx2soap.soap import PartitionedGraph, Plan
from onnx2soap.soap.plan import MAX_BATCH
from onnx2soap.soap.zero import ZeroStage


def register(sub) -> None:
    p = sub.add_parser("simulate", help="simulate one training step of a plan")
    p.add_argument("plan", help="plan file, or a model with ONNX multi-device annotations (.onnx)")
    p.add_argument("--machine", help="preset or machine file (default: the plan's, else cpu:N)")
    p.add_argument("--model", help="model file (default: the plan's)")
    p.add_argument(
        "--batch",
        type=int_in(1, MAX_BATCH),
        help="an annotated model without onnx2soap's metadata: the batch that binds its "
        "symbolic batch dim",
    )
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of the timeline")
    p.add_argument("--json", action="store_true")
    add_costs_option(p)
    p.add_argument(
        "--optimizer",
        choices=list(OPTIMIZER_SLOTS),
        default="sgd",
        help="the optimizer the plan will train with: its state counts in device memory",
    )
    p.set_defaults(run=run)


def plan_on_machine(args: argparse.Namespace, batch: int | None = None) -> PlanOnMachine:
    """What ``simulate``, ``compare`` and ``show`` read first (``args.plan``, ``.model``,
    ``.machine``): the model must be the plan's and the machine its size. ``args.plan``
    may be an annotated model (``batch``: see ``read_plan``)."""
    return place(read_plan(args.plan, batch), str(args.plan), args.model, args.machine)


def partitioned(args: argparse.Namespace, planned: PlanOnMachine) -> PartitionedGraph:
    """The plan's strategy on its model (sim/planned.py: ``partition``)."""
    return partition(planned)


def refuse_pipeline(planned: PlanOnMachine, option: str) -> None:
    """A pipeline plan's step is timed stage by stage from one microbatch's task graph
    (sim/pipeline_price.py): no timeline of the whole step to draw or trace yet."""
    if planned.plan.pipeline:
        raise UserError(
            f"{option} cannot show a pipeline plan's step yet (it is timed per stage; "
            "see simulate --json)"
        )


def run(args: argparse.Namespace) -> int:
    if args.trace:
        check_output(args.trace)  # before the work, not after it
    planned = plan_on_machine(args, args.batch)
    if args.trace:
        refuse_pipeline(planned, "--trace")
    machine, plan = planned.machine, planned.plan
    priced = price(planned, args.optimizer, args.costs)
    ev, costs = priced.evaluation, priced.costs
    if args.trace:
        tg = priced.simulator.task_graph(priced.graph, names=True)
        write_trace(args.trace, tg, simulate(tg), machine)
    if args.json:
        doc = {
            "step_time_s": ev.step_time_s,
            "peak_memory_bytes": list(ev.peak_memory_bytes),
            "bytes_moved": ev.bytes_moved,
            "fits": ev.fits,
            "machine": machine.name,
            "costs": costs.name,
            "zero_stage": int(plan.zero_stage),
            "zero_stages": {w: int(z) for w, z in plan.zero_weights},
            "recomputed_ops": len(plan.recompute),
            "pipeline": _pipeline_doc(ev),
        }
        print(json.dumps(doc))
        return 0
    print(f"{args.plan} on {machine.name}: step time {seconds(ev.step_time_s)}")
    print(f"  costs            {costs.description}")
    if plan.zero:
        print(f"  ZeRO             {_zero(plan)}")
    if plan.recompute:
        print(f"  recompute        {len(plan.recompute)} ops' activations, in the backward")
    for line in _pipeline_lines(plan, ev):
        print(line)
    print(f"  moved per step   {ev.bytes_moved} bytes")
    for d, (m, dev) in enumerate(zip(ev.peak_memory_bytes, machine.devices, strict=False)):
        flag = "" if m <= dev.memory else "  EXCEEDS"
        print(f"  device {d:<3} peak {gib(m)} of {gib(dev.memory)}{flag}")
    if args.trace:
        print(f"  trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    return 0


def _zero(plan: Plan) -> str:
    shards = {
        ZeroStage.NONE: "nothing",
        ZeroStage.OPTIMIZER: "optimizer state",
        ZeroStage.GRADIENTS: "optimizer state and gradients",
        ZeroStage.PARAMETERS: "optimizer state, gradients and weights (gathered for each use)",
    }[plan.zero_stage]
    line = f"stage {int(plan.zero_stage)}: {shards} sharded across data-parallel replicas"
    if plan.zero_weights:
        line += f" (by weight: {plan.zero.label})"
    return line


def _pipeline_doc(ev: Evaluation) -> dict | None:
    """Per stage: a microbatch's forward and backward, the moves to and from the next
    stage, the tail (gradient sync and update), the bubble and the microbatches held."""
    p = ev.pipeline
    if p is None:
        return None
    return {
        "schedule": p.schedule,
        "microbatches": p.microbatches,
        "stages": [
            {
                "devices": list(s.devices),
                "forward_s": s.times.forward_s,
                "backward_s": s.times.backward_s,
                "send_forward_s": s.times.send_forward_s,
                "send_backward_s": s.times.send_backward_s,
                "tail_s": s.times.tail_s,
                "bubble": s.bubble,
                "held_microbatches": s.held,
            }
            for s in p.stages
        ],
    }


def _pipeline_lines(plan: Plan, ev: Evaluation) -> list[str]:
    p = ev.pipeline
    if p is None:
        return []
    lines = [
        f"  pipeline         {len(p.stages)} stages, {p.microbatches} microbatches of "
        f"{plan.graph_batch}, {p.schedule}",
        "    stage  devices    forward   backward      moves       tail  bubble  held",
    ]
    for i, s in enumerate(p.stages):
        t = s.times
        devices = f"{s.devices[0]}-{s.devices[-1]}" if len(s.devices) > 1 else str(s.devices[0])
        moves = seconds(t.send_forward_s + t.send_backward_s)
        lines.append(
            f"    {i:<5}  {devices:<9}{seconds(t.forward_s):>9}  {seconds(t.backward_s):>9}  "
            f"{moves:>9}  {seconds(t.tail_s):>9}  {s.bubble:>5.0%}  {s.held:>4}"
        )
    return lines
