"""An input buffer several local tasks assemble alike is made once (``layout.Assembled``'s
``share``): attention's query, key and value projections under Megatron's plan each
gather the same normed input, and kept three copies of it for their backwards.

One device, in-process: x [B, 64] -> Relu (two tasks, by samples) -> three Gemms that
each read Relu's whole output (assembled from the two tiles) -> summed -> logits. The
three Gemms read one array; numpy holds one such buffer after their forwards, not
three; the memory model takes the other two off (hand count: 2 x B x 64 x 4 bytes)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from executor.data import SyntheticData, rows_needed
from executor.layout import Assembled
from executor.program import Compute, Phase, compile_program
from executor.runtime import Runtime
from executor.step import Step
from onnx2soap.importer import load_model
from onnx2soap.sim.memory import add_edges
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze

BATCH, WIDTH, OUT = 2048, 64, 4
BUFFER = BATCH * WIDTH * 4  # Relu's whole output, float32: 512 KiB
READERS = ("q", "k", "v")


def _model(path: Path) -> Path:
    rng = np.random.default_rng(0)

    def init(name: str, *shape: int) -> TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        *(helper.make_node("Gemm", ["r", f"w{n}"], [n], name=n) for n in READERS),
        helper.make_node("Add", ["q", "k"], ["qk"], name="add1"),
        helper.make_node("Add", ["qk", "v"], ["logits"], name="add2"),
    ]
    graph = helper.make_graph(
        nodes,
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", OUT])],
        [init(f"w{n}", WIDTH, OUT) for n in READERS],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


class _Alone:
    def make_groups(self, groups) -> None:
        list(groups)

    def let_go(self) -> None:
        """Nothing is sent: nothing to let go of."""


def _plan(tmp_path: Path):
    model = load_model(_model(tmp_path / "shared.onnx"), BATCH)
    graph = model.graph
    space = analyze(graph)
    configs = {op.name: ParallelConfig((1,) * len(space[op.name]), (0,)) for op in graph.ops}
    configs["relu"] = ParallelConfig((2, 1), (0, 0))  # two tiles: the readers assemble them
    return model, Partitioner(graph).partition(Strategy(1, configs))


def test_readers_of_one_region_share_one_assembled_buffer(tmp_path: Path) -> None:
    model, pg = _plan(tmp_path)
    rt = Runtime(
        pg, compile_program(pg, 0), _Alone(), dict(model.weights), np.float32, model.constants
    )
    index = {op.name: i for i, op in enumerate(rt.graph.ops)}
    keys = [(index[n], 0) for n in READERS]
    sources = [rt.buffers.inputs[key][0] for key in keys]
    assert all(isinstance(s, Assembled) and len(s.copies) == 2 for s in sources)
    assert rt.buffers.readers[sources[0].share] == 3
    batch = SyntheticData(rt.graph, 0, rt.dtype).batch(1, rows_needed(rt.pg, 0))
    step = Step(rt, batch, training=True)
    dispatch = step.dispatch()
    tracemalloc.start()
    try:
        for ins in rt.program.instructions:
            if isinstance(ins, Compute) and ins.phase is Phase.FORWARD and ins.op == keys[0][0]:
                before, _ = tracemalloc.get_traced_memory()  # Relu's tiles made
            dispatch[type(ins)](ins)
            if isinstance(ins, Compute) and ins.phase is Phase.FORWARD and ins.op == keys[-1][0]:
                after, _ = tracemalloc.get_traced_memory()
                first = step.inputs[keys[0]][0]
                assert all(step.inputs[key][0] is first for key in keys)  # one array
                assert not step.assembled  # the last reader has taken it
    finally:
        tracemalloc.stop()
    # one buffer and three small outputs, where three buffers were 3 x 512 KiB
    assert after - before < 1.25 * BUFFER


def test_the_memory_model_counts_one_buffer(tmp_path: Path) -> None:
    _, pg = _plan(tmp_path)
    edges = add_edges([0], pg, 4, objects=False)
    index = {op.name: i for i, op in enumerate(pg.graph.ops)}
    assert index["q"] not in edges.kept_inputs  # the first reader makes it, keeps it
    for name in ("k", "v"):
        assert dict(edges.kept_inputs[index[name]]) == {0: -BUFFER}
