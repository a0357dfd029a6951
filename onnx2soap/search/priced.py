"""What the search's outer choice prices: a plan's shape and pricing, and a priced plan
(``pipeline_choice`` prices the grid, ``pipeline_walk`` walks from its best)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from onnx2soap.ir import Graph
from onnx2soap.precision import Precision
from onnx2soap.search.pipeline_rule import Space
from onnx2soap.sim import Evaluation, Machine, Simulator, make_simulator
from onnx2soap.sim.costs import CostModel
from onnx2soap.soap import Strategy
from onnx2soap.soap.buckets import DEFAULT_BUCKET_MB
from onnx2soap.soap.pipeline import Pipeline, Schedule
from onnx2soap.soap.zero import Zero, ZeroStage


@dataclass(frozen=True)
class Shape:
    stages: int  # 0: the walk's own plan, not a pipeline
    microbatches: int
    schedule: Schedule | None
    recompute: bool


@dataclass(frozen=True)
class Candidate:
    """A plan priced by the choice: a pipeline on the microbatch's model, or a plain
    plan (``stages`` 0): the walk's best recomputing, a rule's recomputing, or the
    ``zero`` baseline."""

    shape: Shape
    strategy: Strategy
    graph: Graph
    space: Space
    pipeline: Pipeline | None
    recompute: tuple[str, ...]
    zero_stage: ZeroStage
    evaluation: Evaluation
    of: str = ""  # a plain plan's origin: "walk", or the rule's name; "" for a pipeline
    selective: bool = False  # recomputing all but the products (not ``--recompute all``)
    zero_weights: tuple[tuple[str, ZeroStage], ...] = ()  # weights at another stage

    @property
    def zero(self) -> Zero:
        """Every weight's stage (``zero_stage``, but ``zero_weights``'s)."""
        return Zero(self.zero_stage, self.zero_weights)


@dataclass(frozen=True)
class Pricing:
    """What a plan is priced with: the machine, the optimizer's slots, the precision."""

    machine: Machine
    slots: int
    precision: Precision
    bucket_mb: float = DEFAULT_BUCKET_MB  # gradient buckets (soap/buckets.py)

    def simulator(self, cost: CostModel, **kw) -> Simulator:
        kw.setdefault("bucket_mb", self.bucket_mb)
        return make_simulator(self.machine, cost, self.slots, self.precision, **kw)


@dataclass
class Simulators:
    """One simulator per model size, ZeRO stage and recomputed ops, each made once: its
    memo of durations and per-op memory holds whatever the pipeline's stages
    (``Simulator.memo``), so the grid's shapes of one microbatch size, GPipe after
    1F1B, and the walk inside pipelines share what they have simulated."""

    pricing: Pricing
    made: dict[tuple[int, ZeroStage, frozenset[str]], Simulator] = field(default_factory=dict)

    def get(
        self,
        graph: Graph,
        cost: CostModel,
        zero: Zero | ZeroStage = ZeroStage.NONE,
        recompute: tuple[str, ...] = (),
        pipeline: Pipeline | None = None,
    ) -> Simulator:
        """The simulator of ``graph`` (one model per batch size, with ``cost``) under
        ``zero`` and ``recompute``, pricing ``pipeline``."""
        key = (graph.batch, zero, frozenset(recompute))
        if key not in self.made:
            self.made[key] = self.pricing.simulator(cost, zero=zero, recompute=recompute)
        return replace(self.made[key], pipeline=pipeline)
