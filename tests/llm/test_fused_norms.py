"""The LLaMA family's norms and gates come in fused (``importer/rms_norm.py``,
``importer/silu.py``): Llama's, Mistral's and Qwen2's RMSNorms (two a layer and the
final one) and T5's are each one RMSNormalization, their SiLUs one Swish, nothing of the
chains left; and the fused model's forward equals onnxruntime's on the file as written.
That they still train as torch does is ``tests/llm/test_torch_step.py``'s."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from executor.batch import Batch
from executor.device import CpuDevice
from executor.program import compile_program
from executor.runtime import Runtime
from executor.transport import MpiTransport
from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Partitioner, analyze
from tests.llm.zoo import LAYERS, example_inputs

BATCH = 2  # the exports' example batch
CHAIN_OPS = ("ReduceMean", "Pow", "Sqrt", "Reciprocal", "Sigmoid")
# per family: (RMSNormalizations, Swishes)
FUSED = {
    "llama": (2 * LAYERS + 1, LAYERS),
    "mistral": (2 * LAYERS + 1, LAYERS),
    "qwen2": (2 * LAYERS + 1, LAYERS),
    # the encoder's two a layer and final one, the decoder's three a layer and final one;
    # a ReLU MLP
    "t5": (2 * LAYERS + 1 + 3 * LAYERS + 1, 0),
}


def _forward(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The logits of the whole model on one device, in float64."""
    model = load_model(path, BATCH, LossKind.NONE)
    graph = model.graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    rt = Runtime(
        pg,
        compile_program(pg, 0),
        MpiTransport(MPI.COMM_SELF, CpuDevice()),
        {**model.weights, **model.state},
        np.float64,
        model.constants,
    )
    tiles = rt.forward(Batch(inputs, np.zeros(BATCH, np.int64)))
    return tiles[(graph.producer(graph.output).name, 0)]


@pytest.mark.parametrize("name", list(FUSED))
def test_norms_and_gates_are_fused(llm_onnx, name: str) -> None:
    import onnxruntime as ort

    path = llm_onnx(name)
    counts = Counter(op.type for op in load_model(path, BATCH).graph.ops)
    assert (counts["RMSNormalization"], counts["Swish"]) == FUSED[name]
    assert not any(counts[t] for t in CHAIN_OPS), counts
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {
        i.name: t.numpy() for i, t in zip(session.get_inputs(), example_inputs(name), strict=True)
    }
    (want,) = session.run(None, feeds)
    # onnxruntime rounds the norms' statistics to float32, as the file's casts say; the
    # executor computes them in its float64
    np.testing.assert_allclose(_forward(path, feeds), want, rtol=1e-5, atol=1e-6)
