"""RMSNormalization and Swish against torch's autograd in float64 (``F.rms_norm``,
``F.silu``, ``x · sigmoid(alpha · x)``), with and without the stash the executor keeps
from the forward to the backward; rows split equal the whole; their ``workspace`` against
what their kernels allocate; and what the command line says about an RMSNormalization it
cannot compute. Their forwards against onnxruntime, any split and central differences
are ``tests/ops/test_ops.py``'s, for every case of their definitions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.defs.activations import AlphaAttrs
from onnx2soap.ops.defs.rmsnorm import RMSNormAttrs
from tests.importer.helpers import run_cli
from tests.ops.harness import (
    CaseLoader,
    backward_full,
    config_of,
    forward_full,
    one_task,
    op_of,
    operand_arrays,
    traced_peak,
)
from tests.optional import require

RTOL = 1e-10
EPSILON = 1e-6

# (x's shape, the first normalized axis, the scale's shape: None for none)
NORMS = [
    ((3, 5, 8), 2, (8,)),
    ((3, 5, 8), 2, None),
    ((2, 3, 4, 5), 2, (4, 5)),
    ((4, 3, 6), 1, (1, 6)),  # broadcast along the first normalized axis
]


def _args(shape: tuple[int, ...], stash: dict | None) -> TaskArgs:
    return TaskArgs(out_shape=shape, valid=(), stash=stash)


def _torch_rms_norm(x, axis: int, scale):
    """torch's own RMSNorm over ``[axis, rank)``, the scale multiplied after it (its
    ``weight`` must have the normalized shape; a broadcast one would not)."""
    import torch.nn.functional as F

    y = F.rms_norm(x, x.shape[axis:], None, EPSILON)
    return y if scale is None else y * scale


@pytest.mark.parametrize("stash", [True, False], ids=["stash", "remade"])
@pytest.mark.parametrize(("shape", "axis", "scale_shape"), NORMS, ids=str)
def test_rms_norm_is_torchs(shape, axis, scale_shape, stash: bool) -> None:
    torch = require("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 3
    scale = None if scale_shape is None else rng.standard_normal(scale_shape)
    dy = rng.standard_normal(shape)
    op, attrs = definition("RMSNormalization"), RMSNormAttrs(axis, EPSILON, scale is not None)
    inputs = [x] if scale is None else [x, scale]
    args = _args(shape, {} if stash else None)
    y = op.forward(np, attrs, inputs, args)
    if stash:  # one inverse rms a row, kept for the backward
        assert args.stash["inv"].shape == (*shape[:axis], *(1,) * (len(shape) - axis))
    grads = op.backward(np, attrs, inputs, None, dy, args)

    tx = torch.tensor(x, requires_grad=True)
    ts = None if scale is None else torch.tensor(scale, requires_grad=True)
    ty = _torch_rms_norm(tx, axis, ts)
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=RTOL, atol=0)
    want = [tx.grad.numpy()] + ([] if ts is None else [ts.grad.numpy()])
    assert len(grads) == len(want)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=1e-13)


def test_rms_norm_leaves_its_output_gradient_alone() -> None:
    """Without a scale, dx is made beside dy, never in it: the step may read dy again."""
    x, dy = np.random.default_rng(1).standard_normal((2, 3, 6))
    before = dy.copy()
    op = definition("RMSNormalization")
    op.backward(np, RMSNormAttrs(1, EPSILON, False), [x], None, dy, _args(x.shape, None))
    np.testing.assert_array_equal(dy, before)


def test_rms_norm_rows_split_equal_the_whole(tmp_path: Path) -> None:
    """Rows split three ways and two (every leading dim): the same tiles and gradients as
    one task, to the last bit but for the scale's gradient, a sum over the tasks."""
    case = next(c for c in definition("RMSNormalization").cases if c.id == "rmsnorm_two_axes")
    model = CaseLoader(tmp_path)(case)[1]
    graph, op = model.graph, op_of(model)
    arrays = operand_arrays(case, model, np.random.default_rng(2))
    split = config_of((2, 3, 1, 1))
    whole = forward_full(graph, op, one_task(op), arrays)
    np.testing.assert_array_equal(forward_full(graph, op, split, arrays), whole)
    dy = np.random.default_rng(3).standard_normal(whole.shape)
    want = backward_full(graph, op, one_task(op), arrays, dy)
    got = backward_full(graph, op, split, arrays, dy)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("alpha", [1.0, 0.7, -1.5, 0.0])
def test_swish_is_torchs(alpha: float) -> None:
    """Far into both tails too: no overflow, the small values kept to their last bits."""
    torch = require("torch")
    import torch.nn.functional as F

    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_normal(40) * 4, [-800.0, -40.0, 0.0, 40.0, 800.0]])
    dy = rng.standard_normal(x.shape)
    op, attrs = definition("Swish"), AlphaAttrs(alpha)
    y = op.forward(np, attrs, [x], _args(x.shape, None))
    (grad,) = op.backward(np, attrs, [x], y, dy, _args(x.shape, None))

    tx = torch.tensor(x, requires_grad=True)
    ty = F.silu(tx) if alpha == 1.0 else tx * torch.sigmoid(alpha * tx)
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=RTOL, atol=0)
    np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=RTOL, atol=0)


WORKSPACES = {
    "RMSNormalization": (RMSNormAttrs(2, EPSILON, True), (64, 32, 256)),
    "Swish": (AlphaAttrs(1.0), (64, 32, 256)),
}


@pytest.mark.parametrize("name", list(WORKSPACES))
def test_the_kernels_peaks_are_their_workspace_and_what_they_return(name: str) -> None:
    attrs, shape = WORKSPACES[name]
    op = definition(name)
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(shape).astype(np.float32)]
    if name == "RMSNormalization":
        inputs.append(rng.standard_normal(shape[-1]).astype(np.float32))
    stash: dict = {}
    args = _args(shape, stash)
    y = op.forward(np, attrs, inputs, args)
    dy = np.ones_like(y)
    op.backward(np, attrs, inputs, y, dy, args)  # numpy's caches warm
    forward, y = traced_peak(lambda: op.forward(np, attrs, inputs, replace(args, stash={})))
    backward, grads = traced_peak(lambda: op.backward(np, attrs, inputs, y, dy, args))
    want_forward, want_backward = op.workspace(attrs, [i.shape for i in inputs], shape, 4)
    assert forward == pytest.approx(want_forward + y.nbytes, rel=0.10)
    assert backward == pytest.approx(want_backward + sum(g.nbytes for g in grads), rel=0.10)


def _rms_model(path: Path, **attrs) -> Path:
    nodes = [helper.make_node("RMSNormalization", ["x", "s"], ["y"], name="norm", **attrs)]
    graph = helper.make_graph(
        nodes,
        "rms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 6])],
        [numpy_helper.from_array(np.ones(6, np.float32), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.save(model, path)
    return path


@pytest.mark.parametrize(
    ("attrs", "says"),
    [
        ({"stash_type": 10}, "stash_type 10 is not supported; accepted: 1 (float)"),
        ({"axis": 3}, "axis 3 is out of range for rank 3 (accepted: [-3, 2])"),
    ],
    ids=["stash_type", "axis"],
)
def test_what_it_cannot_compute_is_one_line(tmp_path: Path, attrs, says: str) -> None:
    result = run_cli(["inspect", _rms_model(tmp_path / "rms.onnx", **attrs), "--batch", 2])
    assert result.code == 2 and result.stdout == ""
    (line,) = result.stderr_lines
    assert line.startswith("onnx2soap: error: ")
    assert "node 'norm' (RMSNormalization): " + says in line
