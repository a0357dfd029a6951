"""Megatron-LM's sequence parallelism with samples enough for every device: the loss (no
rule, no feature dim to cut along the sequence) is split by samples over all devices, as
without ``--sequence-parallel``, not put whole on the node's first device.

On LLaMA-3-8B at 16 x 8,192 tokens on grand-teton:1 (TP8, bf16, Adam) the loss on
device 0 took the whole logits there: 502 GB against 361 GB on its peers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.search.megatron import megatron
from onnx2soap.sim.memory import memory_key, peak_memory
from onnx2soap.soap import Partitioner, analyze

BATCH, TOKENS, WIDTH, VOCAB = 4, 8, 16, 32
DEVICES = 4  # one node


def _head(path: Path) -> Path:
    """x [B, S, H] -> Relu (no rule: cut along the sequence) -> MatMul W [H, V] (the LM
    head, by columns) -> logits [B, S, V]; the importer attaches the cross-entropy."""
    w = numpy_helper.from_array(np.ones((WIDTH, VOCAB), np.float32), "W")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W"], ["logits"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", TOKENS, WIDTH])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", TOKENS, VOCAB])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_sequence_parallel_loss_splits_by_samples_over_every_device(tmp_path: Path) -> None:
    graph = load_model(_head(tmp_path / "head.onnx"), BATCH).graph
    space = analyze(graph)
    strategy = megatron(graph, space, DEVICES, DEVICES, sequence_parallel=True)
    relu, loss = graph.ops[0], graph.ops[-1]
    assert loss.is_loss
    # the Relu along the sequence (Megatron-LM's cut), the loss by samples over all 4
    assert strategy[relu.name].degrees == (1, DEVICES, 1)
    assert strategy[loss.name].degrees[0] == DEVICES
    assert sorted(strategy[loss.name].devices) == list(range(DEVICES))

    pg = Partitioner(graph).partition(strategy)
    memo: dict = {}
    peaks = peak_memory(pg, DEVICES, 4, memo, objects=False)
    m = memo[memory_key(loss.name, pg.strategy[loss.name], pg.sums[loss.name])]
    # by hand: each device's loss keeps its own sample's logits for its backward,
    # 1 sample x 8 tokens x 32 words x 4 bytes (whole on device 0 it kept 4 x that)
    mine = BATCH // DEVICES * TOKENS * VOCAB * 4
    assert mine == 1024
    assert dict(m.kept_inputs) == {d: mine for d in range(DEVICES)}
    # no device holds more than another (device 0 held 7,936 bytes more)
    assert len(set(peaks)) == 1
