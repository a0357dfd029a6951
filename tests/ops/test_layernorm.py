"""LayerNormalization against torch's autograd in float64 (``F.layer_norm``), with and
without the stash the executor keeps from the forward to the backward (each row's mean
and inverse deviation); its backward leaves its output gradient alone; its ``workspace``
against what its kernels allocate, as tracemalloc counts it (the executor's ``--trace``
measure). Its forward against onnxruntime, any split and central differences are
``tests/ops/test_ops.py``'s, for every case of its definition."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.defs.layernorm import LayerNormAttrs
from tests.ops.harness import traced_peak
from tests.optional import require

EPSILON = 1e-5

# (x's shape, the first normalized axis, the parameters' shape, with a bias)
NORMS = [
    ((3, 5, 8), 2, (8,), True),
    ((3, 5, 8), 2, (8,), False),
    ((2, 3, 4, 5), 2, (4, 5), True),
]


def _args(shape: tuple[int, ...], stash: dict | None) -> TaskArgs:
    return TaskArgs(out_shape=shape, valid=(), stash=stash)


@pytest.mark.parametrize("stash", [True, False], ids=["stash", "remade"])
@pytest.mark.parametrize(("shape", "axis", "param_shape", "bias"), NORMS, ids=str)
def test_layer_norm_is_torchs(shape, axis, param_shape, bias: bool, stash: bool) -> None:
    torch = require("torch")
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 3 + 1
    params = [rng.standard_normal(param_shape) for _ in range(2 if bias else 1)]
    dy = rng.standard_normal(shape)
    op, attrs = definition("LayerNormalization"), LayerNormAttrs(axis, EPSILON)
    args = _args(shape, {} if stash else None)
    y = op.forward(np, attrs, [x, *params], args)
    if stash:  # a mean and an inverse deviation a row, kept for the backward
        rows = (*shape[:axis], *(1,) * (len(shape) - axis))
        assert args.stash["mean"].shape == rows and args.stash["inv"].shape == rows
    grads = op.backward(np, attrs, [x, *params], None, dy, args)

    tx = torch.tensor(x, requires_grad=True)
    tp = [torch.tensor(p, requires_grad=True) for p in params]
    ty = F.layer_norm(tx, param_shape, *tp, eps=EPSILON)
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    want = [tx.grad.numpy(), *(p.grad.numpy() for p in tp)]
    assert len(grads) == len(want)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_layer_norm_leaves_its_output_gradient_alone() -> None:
    """dx is made beside dy, never in it: the step may read dy again."""
    x, dy = np.random.default_rng(1).standard_normal((2, 3, 6))
    scale, bias = np.random.default_rng(2).standard_normal((2, 6))
    before = dy.copy()
    op, attrs = definition("LayerNormalization"), LayerNormAttrs(1, EPSILON)
    op.backward(np, attrs, [x, scale, bias], None, dy, _args(x.shape, None))
    np.testing.assert_array_equal(dy, before)


@pytest.mark.parametrize("shape", [(64, 32, 256), (2, 512, 512)])
def test_the_kernels_peaks_are_their_workspace_and_what_they_return(shape) -> None:
    op, attrs = definition("LayerNormalization"), LayerNormAttrs(len(shape) - 1, EPSILON)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(np.float32)
    inputs = [x, *rng.standard_normal((2, shape[-1])).astype(np.float32)]
    args = _args(shape, {})
    y = op.forward(np, attrs, inputs, args)
    dy = np.ones_like(y)
    op.backward(np, attrs, inputs, y, dy, args)  # numpy's caches warm
    forward, y = traced_peak(lambda: op.forward(np, attrs, inputs, replace(args, stash={})))
    backward, grads = traced_peak(lambda: op.backward(np, attrs, inputs, y, dy, args))
    want_forward, want_backward = op.workspace(attrs, [i.shape for i in inputs], shape, 4)
    assert forward == pytest.approx(want_forward + y.nbytes, rel=0.10)
    assert backward == pytest.approx(want_backward + sum(g.nbytes for g in grads), rel=0.10)
