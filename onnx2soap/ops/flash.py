"""Blockwise attention kernels (FlashAttention-2's algorithm), on numpy or CuPy.

softmax(scale * Q Kᵀ + mask) V without the [queries, keys] matrix: the queries go in
blocks, and for each the keys in blocks, with an online softmax (a running maximum and
sum per row rescale what was accumulated so far). Only tiles of ``block_q`` × ``block_k``
scores live at a time. The forward keeps its output and each row's log-sum-exp (where
the executor gives it a place, ``TaskArgs.stash``; elsewhere the backward remakes it in
one more pass over the keys), and the backward remakes each tile's probabilities:

    P = exp(S - lse)   dV += Pᵀ dO   dP = dO Vᵀ   dS = P ∘ (dP - rowsum(dO ∘ O))
    dQ += scale · dS K   dK += scale · dSᵀ Q

On a CPU each numpy pass over a tile costs a fair share of a product, so the loops make
few: tiles are laid out keys by rows (Sᵀ: the reductions over the keys run down its
columns, numpy's fast path) in buffers made once per call (``out=``); the causal
triangle is added only to the tiles that cross the diagonal (made once per shape); the
forward takes its exponentials against a per-row base that moves only where the scores
leave its slack (``_ForwardRows``), its rows' sums made by the product with [V | 1];
and the backward folds ``- lse`` and ``- rowsum(dO ∘ O)`` into its products (a column
of ones on K and V, the rows' terms on Q and dO). Left per tile: the products, one
exponential and, in the backward, dS's product with P.

Ring attention (``forward_streamed``, ``backward_streamed``): the keys in blocks that
arrive one after another, each block's output and log-sum-exp combined with the running
ones (the online softmax carried across blocks); the backward, given the combined
log-sum-exp, makes each block's dK and dV and its share of dQ.

Grouped-query attention needs no copy of the keys: the ``g = heads / kv_heads`` query
heads of a key head are stacked as rows of one product ([b, kv_heads, g, rows, e]).

Shapes: q [b, h, m, e], k [b, hk, n, e], v [b, hk, n, d], mask broadcastable to
[b, h, m, n] (additive floats, or 0/1 ids where 1 attends). ``first_row`` is the global
index of q's first row: a causal mask (key j seen by query i where j <= i, aligned at the
top left as ONNX's and torch's) needs it where the queries are split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

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
    first_key: int = 0  # the global index of the call's first key (a block of them)

    def keep(self, xp, shape: tuple[int, ...], rows: tuple[int, int], cols: tuple[int, int]):
        """The tile's kept-and-scaled factors, shaped [b, hk, g, rows, cols]."""
        b, hk, g = shape[:3]
        origin = (*self.origin[:2], self.origin[2] + rows[0], self.first_key + cols[0])
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


def _product(xp, a: Array, b: Array, out: Array, dtype) -> Array:
    """``a @ b`` written into ``out`` (a view of a ``_Scratch``), multiplied in ``dtype``
    as ``kernel_util.matmul`` does where one is given."""
    if dtype is None:
        return xp.matmul(a, b, out=out)
    out[...] = matmul(xp, a, b, dtype)
    return out


class _Scratch:
    """One buffer for a tile's operand, viewed as each tile's shape (edge tiles are
    smaller): the loops write into it instead of allocating a tile per step."""

    def __init__(self, xp, shape: tuple[int, ...], dtype) -> None:
        self.flat = xp.empty(math.prod(shape), dtype=dtype)

    def view(self, shape: tuple[int, ...]) -> Array:
        return self.flat[: math.prod(shape)].reshape(shape)


def _widened(xp, x: Array, ones: bool) -> Array:
    """``x`` with, where ``ones``, a last column of ones (a copy): a product against it
    adds the other operand's last column to each of its elements (a row's shift, folded
    into the product instead of a pass over the tile)."""
    if not ones:
        return x
    out = xp.empty((*x.shape[:-1], x.shape[-1] + 1), dtype=x.dtype)
    out[..., :-1] = x
    out[..., -1] = 1
    return out


def _transposed(xp, x: Array, scale: float | None, term: Array | None, buffer: _Scratch):
    """The rows ``x`` [..., r, w] as the right operand of a tile's product: times
    ``scale``, transposed to [..., w, r] and contiguous (BLAS's fastest layout here),
    with ``term`` [..., r, 1] as a last row (the other side of ``_widened``'s ones)."""
    width = x.shape[-1]
    out = buffer.view((*x.shape[:-2], width + (term is not None), x.shape[-2]))
    xp.multiply(xp.swapaxes(x, -1, -2), 1.0 if scale is None else scale, out=out[..., :width, :])
    if term is not None:
        out[..., width:, :] = xp.swapaxes(term, -1, -2)
    return out


def _as_column(x: Array) -> Array:
    """[..., 1, r] (the rows' statistics, along a tile's last axis) as [..., r, 1]."""
    return x.reshape(*x.shape[:-2], x.shape[-1], 1)


def _as_row(xp, x: Array) -> Array:
    """[..., r, 1] as [..., 1, r], to broadcast along a tile's rows (a view)."""
    return xp.swapaxes(x, -1, -2)


class _Tiles:
    """The score tiles of one call, laid out keys by rows ([b, hk, g, keys, rows]: Sᵀ),
    and what is added to them: the mask, -inf past the diagonal where causal. In this
    layout the reductions over the keys run down a tile's columns and the rows'
    statistics broadcast along its contiguous rows, numpy's fast paths (a max along the
    rows of a [rows, keys] tile takes about twice as long)."""

    def __init__(self, xp, q: Array, k: Array, mask: Array | None, problem: Problem) -> None:
        self.xp, self.problem = xp, problem
        self.kv_heads = k.shape[1]
        self.q = _grouped(q, self.kv_heads)  # [b, hk, g, m, e]
        self.mask = _mask_rows(mask, self.kv_heads)
        self.n = k.shape[2]
        b, hk, g, m, _ = self.q.shape
        self.block_q, self.block_k = blocks(b * hk * g, m, self.n, problem)
        self._triangles: dict[tuple[int, int, int], Array] = {}

    def key_stop(self, rows: tuple[int, int]) -> int:
        """Keys past the last one any of these rows sees (causal) are never touched."""
        if not self.problem.causal:
            return self.n
        return max(0, min(self.n, self.problem.first_row + rows[1]))

    def key_spans(self, rows: tuple[int, int]) -> Iterator[tuple[int, int]]:
        return _spans(self.n, self.block_k, self.key_stop(rows))

    def shape(self, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[int, ...]:
        """A tile's shape, [b, hk, g, keys, rows]."""
        return (*self.q.shape[:3], cols[1] - cols[0], rows[1] - rows[0])

    def rows_shape(self, rows: tuple[int, int], width: int) -> tuple[int, ...]:
        """A row block's operand's shape, [b, hk, g, rows, width]."""
        return (*self.q.shape[:3], rows[1] - rows[0], width)

    def scratch(self, width: int = 0) -> _Scratch:
        """A buffer for the largest tile, or with ``width`` for a row block's operand."""
        rows, cols = (0, self.block_q), (0, self.block_k)
        shape = self.rows_shape(rows, width) if width else self.shape(rows, cols)
        return _Scratch(self.xp, shape, self.q.dtype)

    def mask_into(self, s: Array, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """Adds the mask's tile to ``s`` and hides the keys past the diagonal, in place."""
        xp, (i0, i1), (j0, j1) = self.xp, rows, cols
        if self.mask is not None:
            m = self.mask
            block = m[..., i0:i1, :] if m.shape[3] != 1 else m
            block = block[..., j0:j1] if m.shape[4] != 1 else block
            if block.dtype.kind != "f":  # 0/1 ids: 1 attends
                block = xp.where(block != 0, 0.0, -xp.inf).astype(s.dtype)
            s += xp.swapaxes(block, -1, -2)
        first = self.problem.first_row
        if self.problem.causal and j1 - 1 > first + i0:  # the tile crosses the diagonal
            # keys up to the first row's are seen by every row: only those past it change
            lo = max(0, first + i0 + 1 - j0)
            s[..., lo:, :] += self._triangle(j1 - j0 - lo, i1 - i0, first + i0 - j0 - lo, s.dtype)

    def _triangle(self, keys: int, rows: int, diagonal: int, dtype) -> Array:
        """[keys, rows]: 0 where key j is seen by query i (j <= i + diagonal), else -inf.
        Made once per shape: every row block's diagonal tile has one of a few."""
        at = (keys, rows, diagonal)
        if at not in self._triangles:
            xp = self.xp
            seen = xp.tri(rows, keys, diagonal, dtype=bool)  # [rows, keys]
            hidden = xp.where(seen, 0.0, -xp.inf).astype(dtype)
            self._triangles[at] = xp.ascontiguousarray(xp.swapaxes(hidden, 0, 1))
        return self._triangles[at]

    def keep(self, rows: tuple[int, int], cols: tuple[int, int]) -> Array | None:
        """The dropout's factors for a tile, [b, hk, g, keys, rows]; None without one."""
        drop = self.problem.dropout
        if drop is None:
            return None
        factor = drop.keep(self.xp, self.q.shape, rows, cols).astype(self.q.dtype)
        return self.xp.swapaxes(factor, -1, -2)


def _groups_summed(x: Array) -> Array:
    """[b, hk, g, r, c] summed over the g query heads of each key head (a view for g = 1)."""
    return x[:, :, 0] if x.shape[2] == 1 else x.sum(axis=2)


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
    b, hk, g, m, _ = tiles.q.shape
    d = v.shape[-1]
    # P [V | 1] makes the rows' sums with P V, not in a pass over P; not where the
    # dropout drops from P V what the sums keep, nor where float16 would round them
    summed = problem.dropout is None and problem.matmul_dtype is None
    values = _widened(xp, v[:, :, None], summed)  # [b, hk, 1, n, d (+ 1)]
    run = _ForwardRows(tiles, k[:, :, None], values, summed)
    out = xp.empty((b, hk, g, m, d), dtype=q.dtype)
    lse = xp.empty((b, hk, g, m, 1), dtype=q.dtype)
    for rows in _spans(m, tiles.block_q):
        acc, base, total = run(rows)
        # a row that sees no key (every one masked) outputs 0, as ONNX's Attention
        seen = total > 0
        total = xp.where(seen, total, 1)
        xp.divide(acc[..., :d], total, out=out[..., rows[0] : rows[1], :])
        normalizer = base + xp.log(total)
        lse[..., rows[0] : rows[1], :] = xp.where(seen, normalizer, xp.inf)
    return out.reshape(b, hk * g, m, d), lse


class _ForwardRows:
    """One row block's online softmax over its keys, in buffers made once per call.

    The exponentials are taken against a per-row ``base`` (0 at first) that moves only
    where it must: to a tile's maximum where that is more than ``slack`` above it (an
    exponential could overflow), or below it in a row that has summed nothing yet (they
    could underflow). Within the slack the sums stay finite and each row's largest
    exponential normal, so the result is FlashAttention's, and a tile skips the
    subtraction and the rescaling. On the host a tile is even tried before its maximum
    is known: its row sums, which the product with [V | 1] makes anyway, tell whether it
    stayed within the slack, and only a tile that did not (rare: scores seldom move that
    far) takes the maximum and is redone; where more than about one in four are redone
    (scores that keep climbing), the call stops trying. On a GPU that test would stall
    the stream for its answer: there every tile takes its maximum first."""

    def __init__(self, tiles: _Tiles, keys: Array, values: Array, summed: bool) -> None:
        self.tiles, self.keys, self.values, self.summed = tiles, keys, values, summed
        xp, dtype = tiles.xp, tiles.q.dtype
        # the scores and their exponentials: two tiles (a third, the triangle, is small)
        self.scores, self.probs = tiles.scratch(), tiles.scratch()
        self.products = tiles.scratch(values.shape[-1])
        self.queries = tiles.scratch(tiles.q.shape[-1])  # (scale · Q)ᵀ, not K's [n, e]
        self.optimistic = xp.__name__ == "numpy"
        self.tries = self.misses = 0
        # exp(slack) summed over a million keys stays far below the dtype's largest
        self.slack = math.log(float(xp.finfo(dtype).max)) / 4
        self.high, self.low = math.exp(self.slack), math.exp(-self.slack)

    def __call__(self, rows: tuple[int, int]) -> tuple[Array, Array, Array]:
        """(P V summed over the keys [b, hk, g, r, d (+ 1)], the base the exponentials
        were taken against and their sum, each [b, hk, g, r, 1])."""
        tiles, xp = self.tiles, self.tiles.xp
        half, width = tiles.problem.matmul_dtype, self.values.shape[-1]
        scale = float(tiles.problem.scale)
        qt = _transposed(xp, tiles.q[..., rows[0] : rows[1], :], scale, None, self.queries)
        base = xp.zeros(tiles.shape(rows, (0, 1)), dtype=qt.dtype)  # [.., 1, r]
        acc = xp.zeros(tiles.rows_shape(rows, width), dtype=qt.dtype)
        total = acc[..., -1:] if self.summed else xp.zeros((*acc.shape[:-1], 1), qt.dtype)
        zero_base = True
        for cols in tiles.key_spans(rows):
            shape, (j0, j1) = tiles.shape(rows, cols), cols
            s = _product(xp, self.keys[..., j0:j1, :], qt, self.scores.view(shape), half)
            tiles.mask_into(s, rows, cols)
            if self.optimistic and 4 * self.misses <= self.tries + 4:
                self.tries += 1
                with xp.errstate(over="ignore", invalid="ignore"):  # such a tile is redone
                    pv, sums = self._exponentials(s, None if zero_base else base, rows, cols)
                if not bool(((sums > self.high) | (total + sums < self.low)).any()):
                    self._add(acc, total, pv, sums)
                    continue
                self.misses += 1
            self._rebase(s, base, acc, total)
            zero_base = False
            self._add(acc, total, *self._exponentials(s, base, rows, cols))
        return acc, _as_column(base), total

    def _exponentials(self, s: Array, base: Array | None, rows, cols):
        """(exp(s - base)ᵀ [V | 1] into ``products``, the rows' sums of exp(s - base))."""
        tiles, xp = self.tiles, self.tiles.xp
        p = self.probs.view(s.shape)
        xp.exp(s if base is None else xp.subtract(s, base, out=p), out=p)
        sums = None if self.summed else _as_column(p.sum(axis=-2, keepdims=True))
        keep = tiles.keep(rows, cols)
        if keep is not None:
            p *= keep
        values = self.values[..., cols[0] : cols[1], :]
        pv = self.products.view((*s.shape[:-2], s.shape[-1], values.shape[-1]))
        pv = _product(xp, xp.swapaxes(p, -1, -2), values, pv, tiles.problem.matmul_dtype)
        return pv, pv[..., -1:] if self.summed else sums

    def _add(self, acc: Array, total: Array, pv: Array, sums: Array) -> None:
        acc += pv
        if not self.summed:  # else ``total`` is acc's last column
            total += sums

    def _rebase(self, s: Array, base: Array, acc: Array, total: Array) -> None:
        """Moves ``base`` (in place) where the tile's maximum left its slack, and rescales
        what was summed against it."""
        xp = self.tiles.xp
        top = s.max(axis=-2, keepdims=True)  # [.., 1, r]
        over = top > base + self.slack
        fresh = _as_row(xp, total) == 0  # nothing summed yet: nothing to rescale
        under = (top < base - self.slack) & (top != -xp.inf) & fresh
        new_base = xp.where(over | under, top, base)
        # capped: a row moved down has summed 0, which exp(inf) would make NaN
        rescale = _as_column(xp.exp(xp.minimum(base - new_base, self.slack)))
        acc *= rescale
        if not self.summed:
            total *= rescale
        base[...] = new_base


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
    grads = _Gradients(xp, tiles, k, v, mask, wanted)
    do, o = _grouped(grad_out, tiles.kv_heads), _grouped(out, tiles.kv_heads)
    for rows in _spans(tiles.q.shape[3], tiles.block_q):
        i0, i1 = rows
        grads.rows(rows, lse[..., i0:i1, :], do[..., i0:i1, :], o[..., i0:i1, :])
    dq, dk, dv, bias = grads.result(q.shape)
    return dq, dk, dv, None if bias is None else bias.reshape(mask.shape)


class _Gradients:
    """The backward's accumulators and the operands its products share, row block by
    row block. Sᵀ - lse = [K | 1] [scale · Q | -lse]ᵀ and dPᵀ - rowsum(dO ∘ O) =
    [V | 1] [dO | -rowsum(dO ∘ O)]ᵀ: each one product, no pass over the tile (not where
    float16 products would round the shift, nor dP's where the dropout multiplies it
    first)."""

    def __init__(self, xp, tiles: _Tiles, k: Array, v: Array, mask, wanted: Wanted) -> None:
        self.xp, self.tiles = xp, tiles
        problem = tiles.problem
        self.scale, self.half = float(problem.scale), problem.matmul_dtype
        self.fold_lse = self.half is None
        self.fold_delta = self.fold_lse and problem.dropout is None
        self.keys = _widened(xp, k[:, :, None], self.fold_lse)  # [b, hk, 1, n, e (+1)]
        self.values = _widened(xp, v[:, :, None], self.fold_delta)
        # dQ = scale · dS K: summed unscaled (K is not copied scaled), scaled once at the end
        self.dq = xp.zeros_like(tiles.q) if wanted.q else None
        self.dk = xp.zeros_like(k) if wanted.k else None
        self.dv = xp.zeros_like(v) if wanted.v else None
        wants_bias = wanted.mask and mask is not None
        self.bias = _BiasGradient(xp, tiles.mask) if wants_bias else None
        e, d = k.shape[-1], v.shape[-1]
        # the probabilities and the scores' gradient: two tiles; the rest, [rows, e]
        self.probs, self.ds = tiles.scratch(), tiles.scratch()
        self.queries, self.grads = tiles.scratch(e + 1), tiles.scratch(d + 1)
        self.scaled, self.row_products = tiles.scratch(e), tiles.scratch(e)  # scale · Q, dS K
        key_block = (*tiles.q.shape[:3], tiles.block_k, max(e, d))
        self.key_products = _Scratch(xp, key_block, k.dtype)  # Pᵀ dO and dSᵀ Q

    def rows(self, rows, lse: Array, do: Array, o: Array) -> None:
        """Adds one row block's share of every gradient."""
        xp, tiles = self.xp, self.tiles
        q = tiles.q[..., rows[0] : rows[1], :]
        delta = (do * o).sum(axis=-1, keepdims=True)  # rowsum(dO ∘ O), [.., r, 1]
        term = -lse if self.fold_lse else None
        qt = _transposed(xp, q, self.scale, term, self.queries)  # [.., e (+1), r]
        term = -delta if self.fold_delta else None
        gt = _transposed(xp, do, None, term, self.grads)  # [.., d (+1), r]
        scaled = xp.multiply(q, self.scale, out=self.scaled.view(q.shape))  # for dK
        for cols in tiles.key_spans(rows):
            shape, (j0, j1) = tiles.shape(rows, cols), cols
            s = _product(xp, self.keys[..., j0:j1, :], qt, self.probs.view(shape), self.half)
            tiles.mask_into(s, rows, cols)
            if not self.fold_lse:
                s -= _as_row(xp, lse)
            p = xp.exp(s, out=s)
            keep = tiles.keep(rows, cols)
            if self.dv is not None:
                dropped = p if keep is None else p * keep
                self.dv[:, :, j0:j1] += _groups_summed(self._key_product(dropped, do))
            if self.dq is None and self.dk is None and self.bias is None:
                continue
            ds = _product(xp, self.values[..., j0:j1, :], gt, self.ds.view(shape), self.half)
            if keep is not None:  # the gradient of the undropped probabilities
                ds *= keep
            if not self.fold_delta:
                ds -= _as_row(xp, delta)
            ds *= p  # dSᵀ
            self._add(ds, rows, cols, scaled)

    def _add(self, ds: Array, rows, cols, scaled: Array) -> None:
        """dS's products: the mask's, dQ's and dK's shares."""
        xp, (j0, j1) = self.xp, cols
        if self.bias is not None:
            self.bias.add(xp.swapaxes(ds, -1, -2), rows, cols)
        if self.dq is not None:  # S = (scale Q) Kᵀ: dQ = scale · dS K
            keys = self.keys[..., j0:j1, : scaled.shape[-1]]
            out = self.row_products.view(scaled.shape)
            product = _product(xp, xp.swapaxes(ds, -1, -2), keys, out, self.half)
            self.dq[..., rows[0] : rows[1], :] += product
        if self.dk is not None:  # dK = dSᵀ (scale Q)
            self.dk[:, :, j0:j1] += _groups_summed(self._key_product(ds, scaled))

    def _key_product(self, tile: Array, rows_operand: Array) -> Array:
        """``tile`` [.., keys, r] times a row block's operand [.., r, w]: [.., keys, w]."""
        shape = (*tile.shape[:-1], rows_operand.shape[-1])
        out = self.key_products.view(shape)
        return _product(self.xp, tile, rows_operand, out, self.half)

    def result(self, q_shape) -> tuple[Array | None, ...]:
        """(dq, dk, dv, the mask's gradient in the rows' layout)."""
        dq = self.dq
        if dq is not None:
            dq *= self.scale
            dq = dq.reshape(q_shape)
        bias = None if self.bias is None else self.bias.total
        return dq, self.dk, self.dv, bias


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


# -- keys in blocks (ring attention) ----------------------------------------------------


def _key_part(xp, mask: Array | None, problem: Problem, span: tuple[int, int]):
    """The mask and the problem of keys ``span`` alone: the causal diagonal and the
    dropout's draws shifted to where those keys lie (query i sees key lo + j where
    lo + j <= first_row + i)."""
    lo, hi = span
    if mask is not None and mask.ndim and mask.shape[-1] != 1:
        mask = mask[..., lo:hi]
    drop = problem.dropout
    if drop is not None:
        drop = replace(drop, first_key=drop.first_key + lo)
    return mask, replace(problem, first_row=problem.first_row - lo, dropout=drop)


def forward_streamed(
    xp,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    problem: Problem,
    blocks: Sequence[Sequence[tuple[int, int]]],
    arrive: Callable[[int], None] | None = None,
) -> tuple[Array, Array]:
    """``forward_with_lse`` over the keys in ``blocks`` (spans of them, together every
    key once), block by block in that order, ``arrive(j)`` called before block ``j``'s
    keys and values are read (ring attention: a block is computed on while the next
    ones arrive). Each span's output and log-sum-exp are combined with the running
    ones by their log-sum-exps: the online softmax carried across spans."""
    hk, g = k.shape[1], q.shape[1] // k.shape[1]
    out = lse = None
    for j, spans in enumerate(blocks):
        if arrive is not None:
            arrive(j)
        for span in spans:
            lo, hi = span
            part, sub = _key_part(xp, mask, problem, span)
            o, s = forward_with_lse(xp, q, k[:, :, lo:hi], v[:, :, lo:hi], part, sub)
            o = _grouped(o, hk)
            s = xp.where(s == xp.inf, -xp.inf, s)  # a row seeing none of these keys
            out, lse = (o, s) if out is None else _combined(xp, out, lse, o, s)
    if out is None:  # no keys at all: every row sees none
        b, _, m, _ = q.shape
        shape = (b, hk, g, m, 1)
        return xp.zeros((b, hk * g, m, v.shape[-1]), q.dtype), xp.full(shape, xp.inf, q.dtype)
    b, _, _, m, d = out.shape
    # a row that sees no key outputs 0 (already) and keeps +inf, as ``forward_with_lse``
    return out.reshape(b, hk * g, m, d), xp.where(lse == -xp.inf, xp.inf, lse)


def _combined(xp, out: Array, lse: Array, o: Array, s: Array) -> tuple[Array, Array]:
    """Two partial softmaxes' outputs and log-sum-exps (-inf: no key seen) as one, in
    ``out`` and ``o``'s memory (no third output-sized array)."""
    top = xp.maximum(lse, s)
    safe = xp.where(top == -xp.inf, 0, top)  # neither saw a key: both weights 0
    a, b = xp.exp(lse - safe), xp.exp(s - safe)
    total = a + b
    seen = total > 0
    norm = xp.where(seen, total, 1)
    out *= a / norm
    o *= b / norm
    out += o
    return out, xp.where(seen, safe + xp.log(norm), -xp.inf)


def backward_streamed(
    xp,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    out: Array,
    grad_out: Array,
    problem: Problem,
    blocks: Sequence[Sequence[tuple[int, int]]],
    wanted: Wanted = Wanted(),
    lse: Array | None = None,
) -> tuple[Array | None, ...]:
    """``backward`` block by block: given the whole output and its log-sum-exp (the
    combined ones), each span's probabilities are exactly the whole softmax's, so dQ
    sums over the spans and dK, dV (and a float mask's gradient) are each span's own."""
    if lse is None:
        lse = forward_streamed(xp, q, k, v, mask, problem, blocks)[1]
    dq = None  # the first span's, the others added into it
    dk = xp.zeros_like(k) if wanted.k else None
    dv = xp.zeros_like(v) if wanted.v else None
    bias = xp.zeros(mask.shape, mask.dtype) if wanted.mask and mask is not None else None
    for spans in blocks:
        for lo, hi in spans:
            part, sub = _key_part(xp, mask, problem, (lo, hi))
            kv = k[:, :, lo:hi], v[:, :, lo:hi]
            grads = backward(xp, q, *kv, part, out, grad_out, sub, wanted, lse)
            if grads[0] is not None:
                dq = grads[0] if dq is None else xp.add(dq, grads[0], out=dq)
            if dk is not None:
                dk[:, :, lo:hi] = grads[1]
            if dv is not None:
                dv[:, :, lo:hi] = grads[2]
            if bias is not None:
                _add_bias(bias, grads[3], (lo, hi))
    return dq, dk, dv, bias


def _add_bias(total: Array, part: Array, span: tuple[int, int]) -> None:
    """A span's share of a float mask's gradient: its keys' columns, or summed in where
    the mask broadcasts along the keys."""
    if total.ndim and total.shape[-1] != 1:
        total[..., span[0] : span[1]] += part
    else:
        total += part
