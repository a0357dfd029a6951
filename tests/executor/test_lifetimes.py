"""Lifetimes (``executor/lifetimes.py``): a step lets go of a tile after its last forward
reader unless a backward reads it, of an input buffer its op's backward does not read
once the forward has run, and of an activation gradient once its producer's backward has
gathered it; a recomputed tile made again goes after the last backward that reads it.

One device, in-process, on x [B, 16] -> Gemm -> Add(b) -> Sigmoid -> Gemm -> logits and
cross-entropy: Add's backward reads nothing, Sigmoid's its output, Gemm's its inputs. So
the first Gemm's tile is gone once Add has run, Add's once Sigmoid has, and Sigmoid's
lives until its own backward (the second Gemm keeps it too, in place). Checked by weak
references to the arrays themselves and by tracemalloc's count of what numpy holds.
"""

from __future__ import annotations

import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from executor.data import SyntheticData, rows_needed
from executor.program import Compute, Phase, compile_program
from executor.runtime import Runtime
from executor.step import Step
from onnx2soap.importer import load_model
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze

BATCH, FEATURES, HIDDEN, CLASSES = 4096, 16, 32, 4
TILE = BATCH * HIDDEN * 4  # a hidden tile, float32: 512 KiB


def _model(path: Path) -> Path:
    rng = np.random.default_rng(0)

    def init(name: str, *shape: int) -> TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b"], ["a"], name="add"),
        helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"),
        helper.make_node("Gemm", ["s", "w2"], ["logits"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        [init("w1", FEATURES, HIDDEN), init("b", HIDDEN), init("w2", HIDDEN, CLASSES)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


class _Alone:
    """One device's transport: nothing crosses."""

    def make_groups(self, groups) -> None:
        list(groups)

    def let_go(self) -> None:
        """Nothing is sent: nothing to let go of."""


def _runtime(tmp_path: Path, recompute: frozenset[str] = frozenset()) -> Runtime:
    model = load_model(_model(tmp_path / "chain.onnx"), BATCH)
    graph = model.graph
    space = analyze(graph)
    one = {op.name: ParallelConfig((1,) * len(space[op.name]), (0,)) for op in graph.ops}
    pg = Partitioner(graph).partition(Strategy(1, one))
    weights = {**model.weights, **model.state}
    program = compile_program(pg, 0)
    return Runtime(pg, program, _Alone(), weights, np.float32, model.constants, recompute=recompute)


def _traced_run(rt: Runtime):
    """Run one training step, after every instruction noting which tiles and input
    gradients are still alive (weak references to them) and numpy's current bytes."""
    names = [op.name for op in rt.graph.ops]
    batch = SyntheticData(rt.graph, 0, rt.dtype).batch(1, rows_needed(rt.pg, rt.rank))
    step = Step(rt, batch, training=True)
    dispatch = step.dispatch()
    tiles: dict[str, weakref.ref] = {}
    grads: dict[str, weakref.ref] = {}
    seen = []
    tracemalloc.start()
    try:
        for ins in rt.program.instructions:
            dispatch[type(ins)](ins)
            # (no local name may hold an array past this: it would keep it alive)
            tiles.update({names[k[0]]: weakref.ref(t) for k, t in step.outputs.items()})
            grads.update({names[k[0]]: weakref.ref(_first(g)) for k, g in step.input_grads.items()})
            if isinstance(ins, Compute):
                name = names[ins.op]
                alive = {n for n, r in tiles.items() if r() is not None}
                held = {n for n, r in grads.items() if r() is not None}
                current, _ = tracemalloc.get_traced_memory()
                seen.append((ins.phase, name, alive, held, current))
    finally:
        tracemalloc.stop()
    return seen


def _first(made: list):
    return next(g for g in made if g is not None)


def _after(seen, phase: Phase, name: str):
    return next(s for s in seen if s[0] is phase and s[1] == name)


def test_a_tile_is_gone_after_its_last_reader_unless_a_backward_reads_it(tmp_path) -> None:
    seen = _traced_run(_runtime(tmp_path))
    fwd = Phase.FORWARD
    assert "fc1" not in _after(seen, fwd, "add")[2]  # Add read it last; no backward does
    assert "add" not in _after(seen, fwd, "sigmoid")[2]
    assert {"sigmoid", "fc2"} <= _after(seen, fwd, "loss")[2]  # kept for backwards
    bwd = Phase.BACKWARD
    assert "sigmoid" in _after(seen, bwd, "fc2")[2]  # its own backward is still to come
    assert "sigmoid" not in _after(seen, bwd, "sigmoid")[2]
    # numpy's bytes: the step's end of the forward holds Sigmoid's tile and the logits,
    # not the three hidden tiles a step that freed nothing held
    start = _after(seen, fwd, "fc1")[4] - TILE
    assert _after(seen, fwd, "loss")[4] - start < 1.5 * TILE


def test_an_activation_gradient_is_gone_once_its_producer_has_gathered_it(tmp_path) -> None:
    seen = _traced_run(_runtime(tmp_path))
    bwd = Phase.BACKWARD
    assert "fc2" in _after(seen, bwd, "fc2")[3]  # made, Sigmoid yet to gather it
    assert "fc2" not in _after(seen, bwd, "sigmoid")[3]
    assert "sigmoid" not in _after(seen, bwd, "add")[3]


@pytest.mark.parametrize("kept_by_own_backward", [False, True])
def test_a_tile_made_again_goes_after_the_last_backward_that_reads_it(
    tmp_path, kept_by_own_backward: bool
) -> None:
    """Add recomputed: nothing reads its tile in a backward (Sigmoid's reads its output),
    so it is never made again. Sigmoid recomputed: made again for the second Gemm's
    backward, which reads it in place, and for its own, which reads its output: it stays
    until then, and goes after."""
    op = "sigmoid" if kept_by_own_backward else "add"
    seen = _traced_run(_runtime(tmp_path, frozenset({op})))
    assert op not in _after(seen, Phase.FORWARD, "loss")[2]
    made_again = [s for s in seen if s[0] is Phase.BACKWARD and op in s[2]]
    assert bool(made_again) == kept_by_own_backward
    assert op not in _after(seen, Phase.BACKWARD, "sigmoid")[2]
