"""The blockwise attention kernels against torch's scaled_dot_product_attention (float64,
1e-10): forward and every gradient, with and without causal and additive or boolean
masks, grouped-query heads, tiles of every size down to one row and one key, and the
queries split (a task's causal rows start at its tile's origin)."""

from __future__ import annotations

import numpy as np
import pytest

from onnx2soap.ops import flash
from onnx2soap.ops.base import RandomKey
from onnx2soap.ops.random_bits import uniform

torch = pytest.importorskip("torch")
F = torch.nn.functional

BLOCKS = ((0, 0), (1, 1), (2, 3), (4, 16))
MASKS = (None, (1, 4, 5, 7), (2, 1, 1, 7), (5, 7), "bool")


def _reference(q, k, v, mask, scale, causal, grad):
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    bias = None
    if mask is not None:
        bias = torch.tensor(mask, requires_grad=mask.dtype.kind == "f")
        leaves.append(bias)
    attend = bias if bias is None or mask.dtype.kind == "f" else bias != 0
    if causal and attend is not None:  # torch takes one or the other: both, as one mask
        m, n = q.shape[2], k.shape[2]
        seen = torch.ones(m, n, dtype=torch.bool).tril()
        attend = attend & seen if attend.dtype == torch.bool else attend.masked_fill(~seen, -np.inf)
    out = F.scaled_dot_product_attention(
        *leaves[:3],
        attn_mask=attend,
        is_causal=causal and attend is None,
        scale=scale,
        enable_gqa=True,
    )
    out.backward(torch.tensor(grad))
    return out.detach().numpy(), [x.grad.numpy() if x.grad is not None else None for x in leaves]


def _mask(rng, spec):
    if spec is None:
        return None
    if spec == "bool":  # 0/1 ids, one key always attended so no row is empty
        ids = rng.integers(0, 2, (2, 1, 5, 7))
        ids[..., 0] = 1
        return ids
    return rng.standard_normal(spec)


@pytest.mark.parametrize("blocks", BLOCKS, ids=str)
@pytest.mark.parametrize("mask_spec", MASKS, ids=str)
@pytest.mark.parametrize("causal", (False, True))
def test_blockwise_attention_equals_torch(blocks, mask_spec, causal) -> None:
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 5, 3), (2, 2, 7, 3), (2, 2, 7, 6)))
    mask = _mask(rng, mask_spec)
    problem = flash.Problem(0.6, causal, 0, *blocks)
    out = flash.forward(np, q, k, v, mask, problem)
    grad = rng.standard_normal(out.shape)
    want, want_grads = _reference(q, k, v, mask, 0.6, causal, grad)
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    bias = mask is not None and mask.dtype.kind == "f"
    got = flash.backward(np, q, k, v, mask, out, grad, problem, flash.Wanted(mask=bias))
    for g, w in zip(got, want_grads, strict=False):
        if w is None:  # 0/1 ids take no gradient
            assert g is None
            continue
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    if not bias:
        assert got[3] is None


@pytest.mark.parametrize("causal", (False, True))
def test_split_queries_compute_the_whole_rows(causal) -> None:
    """Each part of the queries, given its first row, computes its rows of the whole."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 9, 4), (1, 2, 9, 4), (1, 2, 9, 4)))
    whole = flash.forward(np, q, k, v, None, flash.Problem(0.5, causal))
    grad = rng.standard_normal(whole.shape)
    dq, dk, dv, _ = flash.backward(np, q, k, v, None, whole, grad, flash.Problem(0.5, causal))
    dk_sum, dv_sum = np.zeros_like(dk), np.zeros_like(dv)
    for lo, hi in ((0, 4), (4, 5), (5, 9)):
        part = flash.Problem(0.5, causal, first_row=lo, block_q=2, block_k=2)
        rows = (slice(None), slice(None), slice(lo, hi))
        out = flash.forward(np, q[rows], k, v, None, part)
        np.testing.assert_allclose(out, whole[rows], rtol=1e-12, atol=1e-13)
        pq, pk, pv, _ = flash.backward(np, q[rows], k, v, None, out, grad[rows], part)
        np.testing.assert_allclose(pq, dq[rows], rtol=1e-12, atol=1e-13)
        dk_sum += pk
        dv_sum += pv
    np.testing.assert_allclose(dk_sum, dk, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dv_sum, dv, rtol=1e-12, atol=1e-13)


def test_unwanted_gradients_are_not_made() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 3, 2)) for _ in range(3))
    out = flash.forward(np, q, k, v, None, flash.Problem(1.0, False))
    wanted = flash.Wanted(q=True, k=False, v=False)
    problem = flash.Problem(1.0, False)
    dq, dk, dv, dmask = flash.backward(np, q, k, v, None, out, out, problem, wanted)
    assert dq is not None and dk is None and dv is None and dmask is None


def test_tiles_stay_far_below_the_scores() -> None:
    """At 8,192 tokens and 32 heads a score tile is a sliver of the [m, n] scores."""
    bq, bk = flash.blocks(2 * 32, 8192, 8192, flash.Problem(1.0, True))
    assert 2 * 32 * bq * bk <= flash.TILE_ELEMENTS
    assert bq * bk * 64 <= 8192 * 8192


def _dropout(ratio: float, origin=(0, 0, 0), full=(2, 4, 6, 7)) -> flash.Dropout:
    return flash.Dropout(ratio, RandomKey(11, 3, 5), 0, origin, full)


@pytest.mark.parametrize("causal", (False, True))
def test_dropout_equals_torch_with_the_same_draws(causal) -> None:
    """The probabilities dropped by the draws of ``random_bits`` over [b, h, m, n],
    scaled by 1 / (1 - ratio), then multiplied by V: torch's autograd through exactly
    that, with its own softmax."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 6, 3), (2, 2, 7, 3), (2, 2, 7, 2)))
    drop = _dropout(0.3)
    problem = flash.Problem(0.8, causal, block_q=4, block_k=3, dropout=drop)
    out = flash.forward(np, q, k, v, None, problem)
    grad = rng.standard_normal(out.shape)
    got = flash.backward(np, q, k, v, None, out, grad, problem)
    keep = uniform(np, drop.key, (0, 0, 0, 0), drop.full, drop.full) >= 0.3
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    scores = tq @ tk.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.8
    if causal:
        scores = scores.masked_fill(torch.ones(6, 7, dtype=torch.bool).triu(1), -np.inf)
    dropped = scores.softmax(-1) * torch.tensor(keep) / 0.7
    want = dropped @ tv.repeat_interleave(2, dim=1)
    want.backward(torch.tensor(grad))
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    for g, w in zip(got[:3], (tq, tk, tv), strict=True):
        np.testing.assert_allclose(g, w.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_dropout_draws_do_not_depend_on_the_split() -> None:
    """Heads and queries split: each part, given its origin, drops what the whole drops."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 6, 3), (2, 2, 7, 3), (2, 2, 7, 2)))
    whole_problem = flash.Problem(0.5, True, dropout=_dropout(0.25))
    whole = flash.forward(np, q, k, v, None, whole_problem)
    grad = rng.standard_normal(whole.shape)
    dq = flash.backward(np, q, k, v, None, whole, grad, whole_problem)[0]
    for heads, rows in (((0, 2), (0, 6)), ((2, 4), (0, 3)), ((2, 4), (3, 6))):
        part = (slice(None), slice(*heads), slice(*rows))
        kv = (slice(None), slice(heads[0] // 2, heads[1] // 2))
        drop = _dropout(0.25, (0, heads[0], rows[0]))
        problem = flash.Problem(0.5, True, rows[0], 2, 3, drop)
        out = flash.forward(np, q[part], k[kv], v[kv], None, problem)
        np.testing.assert_allclose(out, whole[part], rtol=1e-12, atol=1e-13)
        pq = flash.backward(np, q[part], k[kv], v[kv], None, out, grad[part], problem)[0]
        np.testing.assert_allclose(pq, dq[part], rtol=1e-12, atol=1e-13)


def test_a_row_that_sees_no_key_outputs_zeros() -> None:
    """ONNX's Attention gives a fully masked row 0 (torch gives NaN); its gradients are 0."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 3, 2)) for _ in range(3))
    mask = np.ones((3, 3), dtype=np.int64)
    mask[1] = 0
    problem = flash.Problem(1.0, False, block_k=2)
    out = flash.forward(np, q, k, v, mask, problem)
    assert np.all(out[:, :, 1] == 0) and np.all(np.isfinite(out))
    dq, dk, dv, _ = flash.backward(np, q, k, v, mask, out, np.ones_like(out), problem)
    assert np.all(dq[:, :, 1] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


@pytest.mark.parametrize("mask_spec", (None, (1, 4, 5, 7), "bool"), ids=str)
@pytest.mark.parametrize("causal", (False, True))
def test_the_forwards_normalizer_spares_the_backward_a_pass(mask_spec, causal) -> None:
    """The backward given the forward's log-sum-exp (what the executor keeps in
    ``TaskArgs.stash``) computes what it computes remaking it, a fully masked row too."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 5, 3), (2, 2, 7, 3), (2, 2, 7, 6)))
    mask = _mask(rng, mask_spec)
    if mask_spec == "bool":
        mask[0, 0, 2] = 0  # a row that sees no key
    problem = flash.Problem(0.6, causal, 0, 2, 3)
    out, lse = flash.forward_with_lse(np, q, k, v, mask, problem)
    np.testing.assert_array_equal(out, flash.forward(np, q, k, v, mask, problem))
    grad = rng.standard_normal(out.shape)
    wanted = flash.Wanted(mask=mask is not None and mask.dtype.kind == "f")
    remade = flash.backward(np, q, k, v, mask, out, grad, problem, wanted)
    kept = flash.backward(np, q, k, v, mask, out, grad, problem, wanted, lse)
    for a, b in zip(remade, kept, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)
