"""The resume probe (``measure/probe_resume.py``): what it divides by, checked on the
simulator with hand-counted hand-offs. The probe itself runs under mpiexec in
``tests/sim/test_machine.py``'s ``machine probe`` tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.transport import SLEEPS_AFTER_S
from onnx2soap.measure.probe_resume import OPS, charged, handed_plan, matmul_chain_model
from tests.sim.tiny import round_machine


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_handed_chain_resumes_once_a_hand_off(tmp_path: Path, ranks: int) -> None:
    """The chain in runs of OPS / ranks matrix products, one run per rank: ranks - 1
    hand-offs forward and as many back, each to a rank that waited at least a run (on
    ``round_machine``, 1 GFLOP/s: a run's forward alone takes over SLEEPS_AFTER_S), so
    the simulator charges ``2 (ranks - 1)`` resumes, all on the step's critical path;
    the chain on one rank waits for nothing and is charged none."""
    graph = matmul_chain_model(tmp_path).graph
    assert sum(op.type == "MatMul" for op in graph.ops) == OPS
    machine = round_machine(ranks)
    handed, alone = handed_plan(graph, ranks, True), handed_plan(graph, ranks, False)
    assert {c.devices for c in handed.strategy.configs.values()} == {(r,) for r in range(ranks)}
    assert charged(machine, SLEEPS_AFTER_S, handed) == 2 * (ranks - 1)
    assert charged(machine, SLEEPS_AFTER_S, alone) == 0
