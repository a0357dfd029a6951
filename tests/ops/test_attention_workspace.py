"""The attention op's ``workspace`` against what its kernels allocate beyond their
output and normalizer (forward) and the gradients they return (backward), as
tracemalloc counts it (the executor's ``--trace`` measure): within 25 %, causal or not,
grouped or not."""

from __future__ import annotations

import numpy as np
import pytest

from onnx2soap.ops import flash
from onnx2soap.ops.defs.attention import AttentionAttrs, streamed_workspace, workspace
from tests.ops.harness import traced_peak

CASES = [  # batch, heads, key heads, tokens, width, causal
    (2, 8, 8, 512, 64, True),
    (1, 8, 2, 1024, 64, False),
    (2, 4, 4, 2048, 32, True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_workspace_is_what_its_kernels_hold(case) -> None:
    b, h, hk, m, e, causal = case
    rng = np.random.default_rng(0)
    q, grad = (rng.standard_normal((b, h, m, e)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, hk, m, e)).astype(np.float32) for _ in range(2))
    problem = flash.Problem(0.1, causal)
    # as the executor runs them: the forward's normalizer kept for the backward
    peak, (out, lse) = traced_peak(lambda: flash.forward_with_lse(np, q, k, v, None, problem))
    forward = peak - out.nbytes - lse.nbytes
    peak, grads = traced_peak(
        lambda: flash.backward(np, q, k, v, None, out, grad, problem, lse=lse)
    )
    backward = peak - sum(g.nbytes for g in grads[:3])
    priced = workspace(
        AttentionAttrs(0.1, causal, False), [q.shape, k.shape, v.shape], out.shape, 4
    )
    assert priced[0] == pytest.approx(forward, rel=0.25)
    assert priced[1] == pytest.approx(backward, rel=0.25)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_streamed_workspace_is_what_its_kernels_hold(case) -> None:
    """A query task of ring attention (a quarter of the rows, from the middle) taking the
    keys in 4 blocks of a quarter each, its own first: ``streamed_workspace`` (a
    block's call on its keys alone, and beside it the running output; dQ summed beside
    each block's, and the block's dK and dV) within 25 % of what tracemalloc counts."""
    b, h, hk, m, e, causal = case
    rng = np.random.default_rng(1)
    rows = m // 4
    q, grad = (rng.standard_normal((b, h, rows, e)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, hk, m, e)).astype(np.float32) for _ in range(2))
    problem = flash.Problem(0.1, causal, first_row=m // 2)
    spans = [(i * rows, (i + 1) * rows) for i in (2, 1, 0, 3)]
    blocks = [[s] for s in spans]
    peak, (out, lse) = traced_peak(
        lambda: flash.forward_streamed(np, q, k, v, None, problem, blocks)
    )
    forward = peak - out.nbytes - lse.nbytes
    peak, grads = traced_peak(
        lambda: flash.backward_streamed(np, q, k, v, None, out, grad, problem, blocks, lse=lse)
    )
    backward = peak - sum(g.nbytes for g in grads[:3])
    attrs, shapes = AttentionAttrs(0.1, causal, False), [q.shape, k.shape, v.shape]
    priced = streamed_workspace(attrs, shapes, out.shape, 4, rows)
    assert priced[0] == pytest.approx(forward, rel=0.25)
    assert priced[1] == pytest.approx(backward, rel=0.25)
