"""Integers computed from the data, in one graph built by hand: RoBERTa's position ids (a
running count of the tokens that are not padding, times the mask, plus the padding id),
T5's shift-right of the ids (a slice written by ScatterND into a constant of zeros, the
start id by ScatterElements, -100 replaced by Where), integer division toward zero of
negative numbers, and GatherElements of an integer table by computed positions; the
results index three embeddings whose sum a MatMul turns into token logits.

Checked against onnxruntime on real ids (padding, negative quotients, every position),
and trained on random 2-rank plans exactly like one device, every integer op split by
batch under data parallelism.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.soap import DimKind, analyze
from tests.executor.mpi import assert_same_training, make_plan, mpirun
from tests.llm.runs import one_device

BATCH, TOKENS, VOCABULARY, WIDTH = 4, 6, 11, 3
STEPS, LR = 3, 0.5
PAD, START = 1, 2
POSITIONS = TOKENS + PAD + 1


def _constant(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def build(path: Path, seed: int = 0) -> Path:
    """ids [B, T] int64 -> logits [B, T, V] float32."""
    rng = np.random.default_rng(seed)
    shift = np.arange(1, TOKENS).reshape(-1, 1)  # rows 1..T-1: a slice assignment
    inits = [
        _constant("pad", np.int64(PAD)),
        _constant("pad32", np.int32(PAD)),
        _constant("one", np.array(1, np.int64)),
        _constant("seven", np.array(7, np.int64)),
        _constant("three", np.array(3, np.int64)),
        _constant("minus100", np.int64(-100)),
        _constant("zeros_tb", np.zeros((TOKENS, BATCH), np.int64)),
        _constant("shift", shift.astype(np.int64)),
        _constant("starts", np.array([0, 0], np.int64)),
        _constant("ends", np.array([BATCH, TOKENS - 1], np.int64)),
        _constant("column0", np.zeros((BATCH, 1), np.int64)),
        _constant("start_ids", np.full((BATCH, 1), START, np.int64)),
        _constant("types", rng.integers(0, 3, (BATCH, POSITIONS)).astype(np.int64)),
        *(
            numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
            for name, shape in (
                ("positions", (POSITIONS, WIDTH)),
                ("tokens", (VOCABULARY, WIDTH)),
                ("quotients", (5, WIDTH)),
                ("token_types", (3, WIDTH)),
                ("head", (WIDTH, VOCABULARY)),
            )
        ),
    ]
    node = helper.make_node
    nodes = [
        # RoBERTa: positions = cumsum(mask) * mask + pad, in int32 as torch writes it
        node("Equal", ["ids", "pad"], ["is_pad"]),
        node("Not", ["is_pad"], ["mask"]),
        node("Cast", ["mask"], ["mask32"], to=TensorProto.INT32),
        node("CumSum", ["mask32", "one"], ["count"]),
        node("Mul", ["count", "mask32"], ["kept"]),
        node("Add", ["kept", "pad32"], ["pos32"]),
        node("Cast", ["pos32"], ["pos"], to=TensorProto.INT64),
        # token types by position: an integer table gathered by the computed positions
        node("GatherElements", ["types", "pos"], ["type_ids"], axis=1),
        # T5: the ids shifted right, the start id in front, -100 replaced by the padding id
        node("Slice", ["ids", "starts", "ends"], ["head_ids"]),
        node("Transpose", ["head_ids"], ["head_t"], perm=[1, 0]),
        node("ScatterND", ["zeros_tb", "shift", "head_t"], ["shifted_t"]),
        node("Transpose", ["shifted_t"], ["shifted"], perm=[1, 0]),
        node("ScatterElements", ["shifted", "column0", "start_ids"], ["started"], axis=1),
        node("Equal", ["started", "minus100"], ["ignored"]),
        node("Where", ["ignored", "pad", "started"], ["decoder_ids"]),
        # toward zero: (pos - 7) / 3 is in [-2, 2] for positions 1..T+1
        node("Sub", ["pos", "seven"], ["centred"]),
        node("Div", ["centred", "three"], ["quotient"]),
        node("Add", ["quotient", "three"], ["quotient_ids"]),
        node("Gather", ["positions", "pos"], ["e_pos"]),
        node("Gather", ["tokens", "decoder_ids"], ["e_tok"]),
        node("Gather", ["quotients", "quotient_ids"], ["e_quo"]),
        node("Gather", ["token_types", "type_ids"], ["e_type"]),
        node("Add", ["e_pos", "e_tok"], ["s1"]),
        node("Add", ["s1", "e_quo"], ["s2"]),
        node("Add", ["s2", "e_type"], ["hidden"]),
        node("MatMul", ["hidden", "head"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "integer_data",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [BATCH, TOKENS])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, TOKENS, VOCABULARY])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def _ids(rng: np.random.Generator) -> np.ndarray:
    """Real ids: every token id, with padding at the end of two sequences."""
    ids = rng.integers(0, VOCABULARY, (BATCH, TOKENS), dtype=np.int64)
    ids[ids == PAD] = PAD + 1
    ids[1, -2:] = PAD
    ids[3, -1:] = PAD
    return ids


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("integer_data") / "integer_data.onnx")


def test_forward_equals_onnxruntime(model_path: Path) -> None:
    import onnxruntime as ort

    from executor import backend

    ids = _ids(np.random.default_rng(3))
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"ids": ids})
    (got,) = backend.run_model(onnx.load(model_path), [ids])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_every_integer_op_carries_the_batch(model_path: Path) -> None:
    """No gradient, but split by batch like any other op: every op computing integers
    from the ids has a splittable sample dim; the ids' bound is the embedding's."""
    from executor.data import id_bound

    graph = load_model(model_path).graph
    space = analyze(graph)
    computed = [op for op in graph.ops if not graph.tensors[op.output].dtype.is_float]
    assert {op.type for op in computed} >= {
        "Equal",
        "CumSum",
        "Mul",
        "Add",
        "Sub",
        "Div",
        "GatherElements",
        "ScatterND",
        "ScatterElements",
        "Where",
    }
    for op in computed:
        assert not graph.differentiable(op.output)
        sample = [d for d in space[op.name] if d.kind is DimKind.SAMPLE]
        assert len(sample) == 1 and sample[0].splittable, (op.name, op.type)
    # the ids reach the token embedding through the shift-right: ids below its rows
    assert id_bound(graph, "ids") == VOCABULARY


@pytest.mark.mpi
@pytest.mark.parametrize(("strategy", "seed"), [("random", 3), ("data-parallel", 0)])
def test_two_ranks_train_like_one_device(model_path: Path, tmp_path: Path, strategy, seed):
    rng = np.random.default_rng(seed)
    data = tmp_path / "data.npz"
    ids = np.concatenate([_ids(rng) for _ in range(3)])
    np.savez(data, ids=ids, labels=rng.integers(0, VOCABULARY, ids.shape))
    one = tmp_path / "one.json"
    make_plan(model_path, one, 1, BATCH, "data-parallel")
    losses, weights = one_device(one, data, STEPS, LR)
    plan = tmp_path / f"{strategy}.json"
    make_plan(model_path, plan, 2, BATCH, strategy, seed)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--data", str(data))
    assert_same_training(mpirun(plan, 2, tmp_path, *args), losses, weights, rtol=1e-10)
