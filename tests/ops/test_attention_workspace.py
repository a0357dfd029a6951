"""The attention op's ``workspace`` against what its kernels allocate beyond their
output and normalizer (forward) and the gradients they return (backward), as
tracemalloc counts it (the executor's ``--trace`` measure): within 25 %, causal or not,
grouped or not."""

from __future__ import annotations

import numpy as np
import pytest

from onnx2soap.ops import flash
from onnx2soap.ops.defs.attention import AttentionAttrs, workspace
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
