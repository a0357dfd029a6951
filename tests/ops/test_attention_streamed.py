"""Attention with the keys taken block by block (ring attention's streamed form,
``flash.forward_streamed`` / ``backward_streamed``) against torch's
scaled_dot_product_attention (float64, 1e-10) and the whole-key kernels: forward, the
log-sum-exp, every gradient; causal or not, masks, grouped-query heads, head-tail
blocks out of key order, a query part whose blocks past its diagonal see nothing, and
the dropout's draws."""

from __future__ import annotations

import numpy as np
import pytest

from onnx2soap.ops import flash
from onnx2soap.ops.base import RandomKey
from onnx2soap.ops.random_bits import uniform

torch = pytest.importorskip("torch")
F = torch.nn.functional

# blocks of key spans in arrival order: one block a device; head-tail (a device's two
# chunks), the local one first and the others in ring order
BLOCKS = (
    (((0, 7),),),
    (((4, 7),), ((0, 2),), ((2, 4),)),
    (((2, 3), (4, 5)), ((0, 1), (5, 7)), ((1, 2), (3, 4))),
)


def _torch(q, k, v, mask, scale, causal, grad):
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    attend = None
    if mask is not None:
        attend = torch.tensor(mask, requires_grad=True)
        leaves.append(attend)
    if causal and attend is not None:
        seen = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        attend = attend.masked_fill(~seen, -np.inf)
    out = F.scaled_dot_product_attention(
        *leaves[:3],
        attn_mask=attend,
        is_causal=causal and attend is None,
        scale=scale,
        enable_gqa=True,
    )
    out.backward(torch.tensor(grad))
    return out.detach().numpy(), [x.grad.numpy() for x in leaves]


@pytest.mark.parametrize("blocks", BLOCKS, ids=("one", "contiguous", "head-tail"))
@pytest.mark.parametrize("mask_spec", (None, (1, 4, 7, 7), (2, 1, 1, 7)), ids=str)
@pytest.mark.parametrize("causal", (False, True))
def test_streamed_blocks_equal_torch_and_the_whole_keys(blocks, mask_spec, causal) -> None:
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 7, 3), (2, 2, 7, 3), (2, 2, 7, 5)))
    mask = None if mask_spec is None else rng.standard_normal(mask_spec)
    problem = flash.Problem(0.7, causal, 0, 2, 2)
    arrived: list[int] = []
    out, lse = flash.forward_streamed(np, q, k, v, mask, problem, blocks, arrived.append)
    assert arrived == list(range(len(blocks)))
    whole, whole_lse = flash.forward_with_lse(np, q, k, v, mask, problem)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12, atol=1e-13)
    grad = rng.standard_normal(out.shape)
    want, want_grads = _torch(q, k, v, mask, 0.7, causal, grad)
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    wanted = flash.Wanted(mask=mask is not None)
    got = flash.backward_streamed(np, q, k, v, mask, out, grad, problem, blocks, wanted, lse)
    for g, w in zip(got, want_grads, strict=False):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", (False, True))
def test_a_query_part_streams_its_own_rows(causal) -> None:
    """A task's queries (rows 2..4 of 7, first_row 2) over blocks in ring order, some of
    whose keys lie past its diagonal: its rows of the whole, and its share of dK, dV."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 7, 4), (1, 1, 7, 4), (1, 1, 7, 2)))
    whole = flash.forward(np, q, k, v, None, flash.Problem(0.5, causal))
    grad = rng.standard_normal(whole.shape)
    rows = (slice(None), slice(None), slice(2, 4))
    part = flash.Problem(0.5, causal, first_row=2, block_q=1, block_k=2)
    blocks = (((2, 4),), ((0, 2),), ((4, 7),))  # the last past the diagonal if causal
    out, lse = flash.forward_streamed(np, q[rows], k, v, None, part, blocks)
    np.testing.assert_allclose(out, whole[rows], rtol=1e-12, atol=1e-13)
    want = flash.backward(np, q[rows], k, v, None, out, grad[rows], part)
    got = flash.backward_streamed(np, q[rows], k, v, None, out, grad[rows], part, blocks, lse=lse)
    for g, w in zip(got[:3], want[:3], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)
    if causal:
        assert not got[1][:, :, 4:].any() and not got[2][:, :, 4:].any()


def test_a_row_that_sees_no_key_outputs_zeros() -> None:
    """A bool mask hiding every key from row 0: 0 out, as the whole-key kernel."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s) for s in ((1, 1, 3, 2), (1, 1, 4, 2), (1, 1, 4, 2)))
    mask = np.ones((1, 1, 3, 4), dtype=bool)
    mask[0, 0, 0] = False
    problem = flash.Problem(1.0, False)
    out, lse = flash.forward_streamed(np, q, k, v, mask, problem, (((2, 4),), ((0, 2),)))
    whole, whole_lse = flash.forward_with_lse(np, q, k, v, mask, problem)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-13)
    assert not out[0, 0, 0].any() and np.isinf(lse[0, 0, 0, 0, 0])
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12)


def test_dropout_draws_follow_the_keys_global_index() -> None:
    """Each block's keys draw at their global index: the blocks drop what the whole does."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 6, 3), (2, 2, 6, 3), (2, 2, 6, 2)))
    drop = flash.Dropout(0.3, RandomKey(11, 3, 5), 0, (0, 0, 0), (2, 4, 6, 6))
    problem = flash.Problem(0.8, True, block_q=4, block_k=3, dropout=drop)
    whole = flash.forward(np, q, k, v, None, problem)
    blocks = (((3, 6),), ((0, 3),))
    out, lse = flash.forward_streamed(np, q, k, v, None, problem, blocks)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-13)
    grad = rng.standard_normal(out.shape)
    want = flash.backward(np, q, k, v, None, whole, grad, problem)
    got = flash.backward_streamed(np, q, k, v, None, out, grad, problem, blocks, lse=lse)
    for g, w in zip(got[:3], want[:3], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)
    keep = uniform(np, drop.key, (0, 0, 0, 0), drop.full, drop.full) >= 0.3
    assert 0 < keep.mean() < 1  # the draws drop some and keep some
