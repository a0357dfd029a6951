"""The task costs a plan is priced with (``--costs``): profiled (a cost DB next to the
machine file, for this host), achieved (GPUs' published kernel rates) or the roofline;
``auto`` picks the first that applies. A cost DB measured on another device is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.sim.achieved import RATES, AchievedCost
from onnx2soap.sim.costdb import CostDB, DeviceKind, db_path_for, host_fingerprint
from onnx2soap.sim.costs import CostModel, RooflineCost
from onnx2soap.sim.machine import Machine
from onnx2soap.sim.presets import _is_file
from onnx2soap.sim.profiled import FingerprintMismatch, ProfiledCost, calibrated


class CostsChoice(Enum):
    AUTO = "auto"  # profiled when a matching cost DB sits next to the machine file
    PROFILED = "profiled"
    ACHIEVED = "achieved"  # GPUs' published kernel rates (sim/achieved.py)
    ROOFLINE = "roofline"


@dataclass(frozen=True)
class ChosenCosts:
    model: CostModel
    description: str  # for the command's output

    @property
    def calibrates(self) -> bool:
        """Whether a model's in-step calibration changes the costs (profiled only)."""
        return isinstance(self.model, ProfiledCost)

    @property
    def name(self) -> str:
        if isinstance(self.model, ProfiledCost):
            return "profiled"
        return "achieved" if isinstance(self.model, AchievedCost) else "roofline"

    def for_graph(self, graph: Graph, machine: Machine) -> ChosenCosts:
        """Profiled costs taken into the step by ``graph``'s own calibration where the
        DB has one (``ProfiledCost.for_graph``), the description saying which; the
        roofline as it is. A model profiled at another batch than it is planned at has
        none: every profiled model's curve then misjudges it (GPT-2's tasks run 1.85x
        their isolated time in its own steps, 1.23x by the curve over four models)."""
        if not isinstance(self.model, ProfiledCost):
            return self
        model = self.model.for_graph(graph, machine)
        if not self.model.in_step:
            how = "no in-step calibration"
        elif calibrated(graph, self.model.in_step):
            how = "calibrated in this model's own steps"
        else:
            how = (
                f"calibrated over every profiled step, none of this model at batch "
                f"{graph.batch} (profile it at that batch for its own)"
            )
        return replace(self, model=model, description=f"{self.description}; {how}")


def _achieved(machine: Machine, want: CostsChoice) -> ChosenCosts:
    """The published kernel rates; asked for by name on a machine with devices the
    table lacks, refused (they would be priced by the roofline unsaid)."""
    unknown = [d for d in machine.devices if not AchievedCost.knows(d)]
    if unknown and want is CostsChoice.ACHIEVED:
        first = unknown[0]
        raise UserError(
            f"--costs achieved: no published kernel rates for device {first.name} (its model: "
            f"{first.model or 'none given'}); known models: {', '.join(sorted(RATES))} "
            "(a machine file's devices may name one; or --costs roofline)"
        )
    return ChosenCosts(AchievedCost(), "achieved (published kernel rates, sim/achieved.py)")


def choose_costs(spec: str, machine: Machine, choice: str, dtype: str = "float32") -> ChosenCosts:
    """The cost model for ``machine`` (given as ``spec``). A cost DB measured on another
    device is refused (never used silently), with how to go on."""
    want = CostsChoice(choice)
    roofline = ChosenCosts(RooflineCost(), "roofline")
    if want is CostsChoice.ROOFLINE:
        return roofline
    if want is CostsChoice.ACHIEVED:
        return _achieved(machine, want)
    db = db_path_for(spec) if _is_file(Path(spec)) else None
    if db is None or not db.exists():
        if want is CostsChoice.PROFILED:
            where = f"no cost DB at {db}" if db else f"{spec} is a preset, not a machine file"
            raise UserError(f"--costs profiled: {where}; run onnx2soap profile first")
        known = all(AchievedCost.knows(d) for d in machine.devices)
        return _achieved(machine, want) if known else roofline
    with CostDB.open(db) as opened:
        stored = list(opened.fingerprints().values())
    kinds = [DeviceKind.CUDA] if any(f.kind is DeviceKind.CUDA for f in stored) else []
    here = None
    for kind in [*kinds, DeviceKind.CPU]:
        try:
            fp = host_fingerprint(kind, dtype)
        except UserError:  # no GPU here to match the DB's GPU timings
            continue
        here = here or fp
        if fp in stored:
            cost = ProfiledCost.load(db, fp, machine.devices[0])
            return ChosenCosts(cost, f"profiled ({cost.measured} timings from {db})")
    raise FingerprintMismatch(db, here, stored)
