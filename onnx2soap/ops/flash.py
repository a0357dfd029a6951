"""Blockwise attention kernels (FlashAttention-2's algorithm), on numpy or CuPy.

softmax(scale * Q Kᵀ + mask) V without the [queries, keys] matrix: the queries go in
blocks, and for each the keys in blocks, with an online softmax (a running maximum and
sum per row rescale what was accumulated so far). Only tiles of ``block_q`` × ``block_k``
scores live at a time. The forward keeps its output and each row's log-sum-exp (where
the executor gives it a place, ``TaskArgs.stash``; elsewhere the backward remakes it in
one more pass over the keys), and the backward remakes each tile's probabilities:

    P = exp(S - lse)   dV += Pᵀ dO   dP = dO Vᵀ   dS = P ∘ (dP - rowsum(dO ∘ O))
    dQ += scale · dS K   dK += scale · dSᵀ Q

Grouped-query attention needs no copy of the keys: the ``g = heads / kv_heads`` query
heads of a key head are stacked as rows of one product ([b, kv_heads, g, rows, e]).

Shapes: q [b, h, m, e], k [b, hk, n, e], v [b, hk, n, d], mask broadcastable to
[b, h, m, n] (additive floats, or 0/1 ids where 1 attends). ``first_row`` is the global
index of q's first row: a causal mask (key j seen by query i where j <= i, aligned at the
top left as ONNX's and torch's) needs it where the queries are split.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from onnx2soap.ops.base import Array, RandomKey
from onnx2soap.ops.kernel_util import matmul
from onnx2soap.ops.random_bits import uniform

# Score tiles of up to this many elements (8 MiB in float32): large enough that a tile's
# products run near BLAS's speed, small enough to stay far below the [m, n] scores.
TILE_ELEMENTS = 1 << 21
BLOCK_K = 256
# Causal: rows in blocks of this many at most, so that the tiles past the diagonal
# (skipped) are about half (measured on one CPU thread: 1.3-1.4x faster than 512).
CAUSAL_BLOCK_Q = 128


@dataclass(frozen=True)
class Dropout:
    """Dropout on the probabilities, as a Dropout between the softmax and the product
    with V: each element kept with probability 1 - ratio (and scaled by 1 / (1 - ratio)),
    its draw a function of the key and its global index in [b, h, m, n] alone
    (``random_bits``), so any split of the op drops what one task drops. The softmax's
    normalizer is the undropped one."""

    ratio: float
    key: RandomKey
    stream: int
    origin: tuple[int, int, int]  # the task's first (sample, head, query)
    full: tuple[int, int, int, int]  # [b, h, m, n] of the whole op

    def keep(self, xp, shape: tuple[int, ...], rows: tuple[int, int], cols: tuple[int, int]):
        """The tile's kept-and-scaled factors, shaped [b, hk, g, rows, cols]."""
        b, hk, g = shape[:3]
        origin = (*self.origin[:2], self.origin[2] + rows[0], cols[0])
        tile = (b, hk * g, rows[1] - rows[0], cols[1] - cols[0])
        u = uniform(xp, self.key, origin, tile, self.full, stream=self.stream)
        factor = (u >= self.ratio) * (1.0 / (1.0 - self.ratio))
        return factor.reshape(b, hk, g, *tile[2:])


@dataclass(frozen=True)
class Problem:
    """One call's fixed facts."""

    scale: float
    causal: bool
    first_row: int = 0
    block_q: int = 0  # 0: chosen from the shapes (``blocks``)
    block_k: int = 0
    dropout: Dropout | None = None
    # the dtype the products multiply in (``kernel_util.matmul``: float16 on a GPU in
    # fp16 mixed precision); None: the operands'
    matmul_dtype: object = None


def blocks(batch_heads: int, m: int, n: int, problem: Problem) -> tuple[int, int]:
    """(block_q, block_k): tiles of at most ``TILE_ELEMENTS`` over all heads at once."""
    bk = problem.block_k or min(n, BLOCK_K)
    bq = problem.block_q or max(16, TILE_ELEMENTS // max(1, batch_heads * bk))
    if problem.causal and not problem.block_q:
        bq = min(bq, CAUSAL_BLOCK_Q)
    return min(bq, m), bk


def _spans(size: int, step: int, stop: int | None = None) -> Iterator[tuple[int, int]]:
    end = size if stop is None else min(size, stop)
    for lo in range(0, end, step):
        yield lo, min(end, lo + step)


def _grouped(x: Array, kv_heads: int) -> Array:
    """[b, h, m, x] as [b, kv_heads, h // kv_heads, m, x] (a view)."""
    b, h, m, e = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, m, e)


def _mask_rows(mask: Array | None, kv_heads: int) -> Array | None:
    """The mask as [b|1, kv_heads|1, g|1, m|1, n|1], broadcasting as the scores do."""
    if mask is None:
        return None
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    mb, mh, mm, mn = mask.shape
    if mh == 1:
        return mask.reshape(mb, 1, 1, mm, mn)
    return mask.reshape(mb, kv_heads, mh // kv_heads, mm, mn)


class _Tiles:
    """The score tiles of one call: S = Q_i (scale · K_j)ᵀ + mask, masked where causal.
    The keys are scaled once (a [n, e] copy, not a [rows, keys] pass per tile)."""

    def __init__(self, xp, q: Array, k: Array, mask: Array | None, problem: Problem) -> None:
        self.xp, self.problem = xp, problem
        self.kv_heads = k.shape[1]
        self.q = _grouped(q, self.kv_heads)  # [b, hk, g, m, e]
        self.k = (k * float(problem.scale))[:, :, None]  # [b, hk, 1, n, e], k's dtype
        self.kt = xp.swapaxes(self.k, -1, -2)  # [b, hk, 1, e, n]
        self.mask = _mask_rows(mask, self.kv_heads)
        self.n = k.shape[2]

    def key_stop(self, rows: tuple[int, int]) -> int:
        """Keys past the last one any of these rows sees (causal) are never touched."""
        if not self.problem.causal:
            return self.n
        return max(0, min(self.n, self.problem.first_row + rows[1]))

    def scores(self, rows: tuple[int, int], cols: tuple[int, int]) -> Array:
        xp, (i0, i1), (j0, j1) = self.xp, rows, cols
        s = matmul(xp, self.q[..., i0:i1, :], self.kt[..., j0:j1], self.problem.matmul_dtype)
        if self.mask is not None:
            m = self.mask
            block = m[..., i0:i1, :] if m.shape[3] != 1 else m
            block = block[..., j0:j1] if m.shape[4] != 1 else block
            if block.dtype.kind == "f":
                s += block
            else:  # 0/1 ids: 1 attends
                s = xp.where(block != 0, s, -xp.inf)
        first = self.problem.first_row
        if self.problem.causal and j1 - 1 > first + i0:  # the tile crosses the diagonal
            # key j is hidden from query i where j > i: -inf above diagonal first + i0 - j0
            seen = xp.tri(i1 - i0, j1 - j0, first + i0 - j0, dtype=bool)
            s += xp.where(seen, 0.0, -xp.inf).astype(s.dtype)
        return s


def _groups_summed(x: Array) -> Array:
    """[b, hk, g, r, c] summed over the g query heads of each key head (a view for g = 1)."""
    return x[:, :, 0] if x.shape[2] == 1 else x.sum(axis=2)


def _finite(xp, x: Array) -> Array:
    """A row maximum of -inf (every key masked so far) shifts by 0 instead: exp(-inf - -inf)
    would be NaN where it must be 0."""
    return xp.where(x == -xp.inf, 0.0, x)


def forward(xp, q: Array, k: Array, v: Array, mask: Array | None, problem: Problem) -> Array:
    """softmax(scale · Q Kᵀ + mask) V, [b, h, m, d]."""
    return forward_with_lse(xp, q, k, v, mask, problem)[0]


def forward_with_lse(
    xp, q: Array, k: Array, v: Array, mask: Array | None, problem: Problem
) -> tuple[Array, Array]:
    """(the output [b, h, m, d], each row's log-sum-exp of its scores, grouped as
    [b, hk, g, m, 1]: what ``backward`` reads instead of remaking it; +inf for a row
    that sees no key)."""
    tiles = _Tiles(xp, q, k, mask, problem)
    vv = v[:, :, None]  # [b, hk, 1, n, d]
    b, hk, g, m, _ = tiles.q.shape
    out = xp.empty((b, hk, g, m, v.shape[-1]), dtype=q.dtype)
    lse = xp.empty((b, hk, g, m, 1), dtype=q.dtype)
    bq, bk = blocks(b * hk * g, m, tiles.n, problem)
    for rows in _spans(m, bq):
        shape = (b, hk, g, rows[1] - rows[0], 1)
        top = xp.full(shape, -xp.inf, dtype=q.dtype)
        total = xp.zeros(shape, dtype=q.dtype)
        acc = xp.zeros((*shape[:-1], v.shape[-1]), dtype=q.dtype)
        for cols in _spans(tiles.n, bk, tiles.key_stop(rows)):
            s = tiles.scores(rows, cols)
            new_top = xp.maximum(top, s.max(axis=-1, keepdims=True))
            shift = _finite(xp, new_top)
            s -= shift
            p = xp.exp(s, out=s)
            rescale = xp.exp(top - shift)
            total = total * rescale + p.sum(axis=-1, keepdims=True)
            acc *= rescale
            if problem.dropout is not None:
                p *= problem.dropout.keep(xp, p.shape, rows, cols).astype(p.dtype)
            acc += matmul(xp, p, vv[..., cols[0] : cols[1], :], problem.matmul_dtype)
            top = new_top
        # a row that sees no key (every one masked) outputs 0, as ONNX's Attention
        seen = total > 0
        out[..., rows[0] : rows[1], :] = acc / xp.where(seen, total, 1)
        normalizer = _finite(xp, top) + xp.log(xp.where(seen, total, 1))
        lse[..., rows[0] : rows[1], :] = xp.where(seen, normalizer, xp.inf)
    return out.reshape(b, hk * g, m, v.shape[-1]), lse


@dataclass(frozen=True)
class Wanted:
    """Which of q, k, v take a gradient."""

    q: bool = True
    k: bool = True
    v: bool = True
    mask: bool = False  # a float mask only: an additive bias that trains (T5's)


def backward(
    xp,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    out: Array,
    grad_out: Array,
    problem: Problem,
    wanted: Wanted = Wanted(),
    lse: Array | None = None,
) -> tuple[Array | None, ...]:
    """(dq, dk, dv, dmask) of ``forward``, None where not wanted (or no mask).
    ``lse``: the rows' log-sum-exp ``forward_with_lse`` gave; None: remade here by it,
    in one more pass over the keys (the op tests and the ONNX backend keep none)."""
    if lse is None:
        lse = forward_with_lse(xp, q, k, v, mask, problem)[1]
    tiles = _Tiles(xp, q, k, mask, problem)
    hk = tiles.kv_heads
    do = _grouped(grad_out, hk)  # [b, hk, g, m, d]
    delta = (do * _grouped(out, hk)).sum(axis=-1, keepdims=True)
    vt = xp.swapaxes(v, -1, -2)[:, :, None]  # [b, hk, 1, d, n]
    dq = xp.zeros_like(tiles.q) if wanted.q else None
    dk = xp.zeros_like(k) if wanted.k else None
    dv = xp.zeros_like(v) if wanted.v else None
    bias = _BiasGradient(xp, tiles.mask) if wanted.mask and mask is not None else None
    b, _, g, m, _ = tiles.q.shape
    bq, bk = blocks(b * hk * g, m, tiles.n, problem)
    scale, half = float(problem.scale), problem.matmul_dtype
    for rows in _spans(m, bq):
        (i0, i1), row_lse = rows, lse[..., rows[0] : rows[1], :]
        for cols in _spans(tiles.n, bk, tiles.key_stop(rows)):
            (j0, j1), s = cols, tiles.scores(rows, cols)
            s -= row_lse
            p = xp.exp(s, out=s)
            keep = None
            if problem.dropout is not None:
                keep = problem.dropout.keep(xp, p.shape, rows, cols).astype(p.dtype)
            if dv is not None:
                dropped = p if keep is None else p * keep
                dv_tile = matmul(xp, xp.swapaxes(dropped, -1, -2), do[..., i0:i1, :], half)
                dv[:, :, j0:j1] += _groups_summed(dv_tile)
            if dq is None and dk is None and bias is None:
                continue
            ds = matmul(xp, do[..., i0:i1, :], vt[..., j0:j1], half)
            if keep is not None:  # the gradient of the undropped probabilities
                ds *= keep
            ds -= delta[..., i0:i1, :]
            ds *= p
            if bias is not None:
                bias.add(ds, rows, cols)
            if dq is not None:  # S = Q (scale K)ᵀ: dQ = dS (scale K)
                dq[..., i0:i1, :] += matmul(xp, ds, tiles.k[..., j0:j1, :], half)
            if dk is not None:  # dK = scale · dSᵀ Q, scaled on the [keys, e] tile
                dk_tile = matmul(xp, xp.swapaxes(ds, -1, -2), tiles.q[..., i0:i1, :], half)
                dk_tile = _groups_summed(dk_tile)
                dk_tile *= scale
                dk[:, :, j0:j1] += dk_tile
    dq = None if dq is None else dq.reshape(q.shape)
    return dq, dk, dv, None if bias is None else bias.total.reshape(mask.shape)


class _BiasGradient:
    """An additive mask's gradient: each tile's dS summed over the axes the mask
    broadcasts along, into the mask's shape."""

    def __init__(self, xp, rows_mask: Array) -> None:
        self.total = xp.zeros(rows_mask.shape, dtype=rows_mask.dtype)

    def add(self, ds: Array, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        shape = self.total.shape
        stretched = tuple(a for a in range(5) if shape[a] == 1 and ds.shape[a] != 1)
        part = ds.sum(axis=stretched, keepdims=True) if stretched else ds
        at = [slice(None)] * 5
        if shape[3] != 1:
            at[3] = slice(*rows)
        if shape[4] != 1:
            at[4] = slice(*cols)
        self.total[tuple(at)] += part
