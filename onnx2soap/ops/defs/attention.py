"""Attention (ONNX opset 23): softmax(scale · Q Kᵀ + mask) V as one op, run blockwise
(``onnx2soap.ops.flash``) so no step holds the [queries, keys] scores.

Read from files that write the ONNX op, and from the chains torch's exporters write for
attention, which the importer fuses into it (``onnx2soap.importer.attention``).

Inputs: Q [b, h, m, e], K [b, hk, n, e], V [b, hk, n, d] (4-D: heads given as an axis;
``h`` a multiple of ``hk``, grouped-query attention), an optional mask broadcastable to
[b, h, m, n]: added where it holds floats, attended where it holds true (ids 1).

Its dims: the batch and the heads split as Megatron-LM splits them (a key head with its
``h / hk`` query heads: ``Grouped``), the queries split too (each task reads every key:
the global row of its first query is its tile's origin, for the causal mask). The keys
and the value width are read whole (splitting the value width would remake the scores
per part), but a task whose queries are split over devices takes its keys and values
block by block as they arrive, the partial outputs combined by log-sum-exp (ring
attention: ``OpDef.streams``, ``soap/streamed.py``).

The backward reads Q, K, V, the mask, the output and each row's log-sum-exp, as
FlashAttention's (the executor keeps that in ``TaskArgs.stash``), and remakes the
probabilities tile by tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from onnx2soap.ir import AxisMap, Broadcast, Grouped, Operand, Tensor, Whole, identity
from onnx2soap.ops import flash
from onnx2soap.ops.base import NONE, C, OpDef, Saved, Streamed, W, X, case, wants
from onnx2soap.ops.context import NodeContext, float_attribute, make_op

# Forward work per (query, key) pair beyond the two products: the softmax's max,
# subtract, exp, sum and rescale.
_SOFTMAX_FLOPS = 5


@dataclass(frozen=True)
class AttentionAttrs:
    scale: float
    causal: bool
    has_mask: bool
    dropout: float = 0.0  # the probabilities' dropout ratio, in training
    seed: int = 0  # the dropout's stream (the fused Dropout's seed attribute)
    # the mask is a bool constant, which the IR holds as 0/1 floats: attend where 1
    boolean_mask: bool = False


def _refuse_unsupported(ctx: NodeContext, softcap, qk_matmul_output_mode) -> None:
    if softcap:
        raise ctx.fail(f"softcap={softcap}; only 0 (no soft cap) is supported")
    if qk_matmul_output_mode:
        raise ctx.fail(
            f"qk_matmul_output_mode={qk_matmul_output_mode}; only 0 is supported (the "
            "scores are never made, so they cannot be an output)"
        )
    for i, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
        if i < len(ctx.input_names) and ctx.input_names[i]:
            raise ctx.fail(f"input {i} ({what}) is given; a training step has no cache")


def _check_shapes(ctx: NodeContext, q: Tensor, k: Tensor, v: Tensor) -> None:
    if not len(q.shape) == len(k.shape) == len(v.shape) == 4:
        raise ctx.fail(
            f"Q, K, V have ranks {len(q.shape)}, {len(k.shape)}, {len(v.shape)}; 4-D "
            "inputs [batch, heads, sequence, width] are supported"
        )
    (b, h, _, e), (bk, hk, n, ek), (bv, hv, nv, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv and e == ek and hk == hv and n == nv and hk and h % hk == 0):
        raise ctx.fail(
            f"Q {list(q.shape)}, K {list(k.shape)}, V {list(v.shape)} do not fit: one batch, "
            "Q's and K's widths equal, K's and V's heads and lengths equal, and Q's heads "
            "a multiple of K's"
        )


def _mask_operand(ctx: NodeContext, mask: Tensor, out: tuple[int, ...]) -> Operand:
    """The mask read as broadcast to [b, h, m, n]: its key axis whole (dim 4)."""
    rank = len(mask.shape)
    if rank > 4 or any(s not in (1, o) for s, o in zip(mask.shape, out[-rank:], strict=True)):
        raise ctx.fail(f"mask {list(mask.shape)} does not broadcast to {list(out)}")
    axes: list[AxisMap] = []
    for axis, size in enumerate(mask.shape, start=4 - rank):
        if size == 1 and out[axis] != 1:
            axes.append(Broadcast())
        elif axis == 3:
            axes.append(Whole(dims=(4,)))
        else:
            axes.append(identity(axis))
    return Operand(mask.name, tuple(axes))


def convert(
    ctx: NodeContext,
    *,
    is_causal=0,
    kv_num_heads=0,
    q_num_heads=0,
    qk_matmul_output_mode=0,
    scale=None,
    softcap=0.0,
    softmax_precision=None,
    dropout_ratio=0.0,
    dropout_seed=0,
):
    """ONNX's attributes, and two of onnx2soap's own that only the importer's fusion
    writes (a Dropout between the softmax and the product with V, in training)."""
    _refuse_unsupported(ctx, softcap, qk_matmul_output_mode)
    q, k, v = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2)
    _check_shapes(ctx, q, k, v)
    (b, h, m, e), hk, (n, d) = q.shape, k.shape[1], v.shape[2:]
    if kv_num_heads not in (0, hk) or q_num_heads not in (0, h):
        raise ctx.fail(f"q_num_heads/kv_num_heads disagree with the 4-D inputs ({h}, {hk})")
    mask = _mask(ctx)
    group = h // hk
    # a key head serves ``group`` query heads: the heads split in whole groups
    heads: AxisMap = identity(1) if group == 1 else Grouped(1, group, 1)
    dims = [("n", b), ("h", h), ("m", m), ("d", d), ("k", n)]
    operands = [
        Operand(q.name, (identity(0), identity(1), identity(2), Whole())),
        Operand(k.name, (identity(0), heads, Whole(dims=(4,)), Whole())),
        Operand(v.name, (identity(0), heads, Whole(dims=(4,)), Whole(dims=(3,)))),
    ]
    if mask is not None:
        operands.append(_mask_operand(ctx, mask, (b, h, m, n)))
    causal = bool(is_causal)
    # per point of [b, h, m, d, n]: both products' multiply-adds, the softmax's share;
    # under a causal mask only the points the kernel computes count (``_causal_work``)
    per_point = (2 * e + 2 * d + _SOFTMAX_FLOPS) / d
    scale = 1 / math.sqrt(e) if scale is None else float_attribute(scale)
    if not 0.0 <= dropout_ratio < 1.0:
        raise ctx.fail(f"dropout_ratio={dropout_ratio}; accepted: 0 <= ratio < 1")
    boolean = ctx.is_constant(3) and ctx.constant(3).dtype == bool
    attrs = AttentionAttrs(
        scale, causal, mask is not None, float_attribute(dropout_ratio), int(dropout_seed), boolean
    )
    op = make_op(ctx, operands, attrs, dims, range(4), max(1, round(per_point)))
    if causal:
        op = replace(op, nest=replace(op.nest, causal=_causal_work(b * h, n)))
    if group == 1:
        return op
    dims = list(op.nest.dims)
    dims[1] = replace(dims[1], granule=group)
    return replace(op, nest=replace(op.nest, dims=tuple(dims)))


def _causal_work(batch_heads: int, keys: int) -> tuple[int, int, int]:
    """The nest's causal pair (queries ``m``, keys ``k``) and the rows a block the
    kernel skips by: each block of queries computes every key up to its last row's
    (the diagonal tile whole, masked), none past it, so a task's work is that staircase,
    wherever its queries lie (the last of contiguous chunks does the most). The block
    is the whole op's (``flash.blocks``: 128 rows where batch x heads is at most 64, as
    LLaMA's 32 heads a sequence; down to 16 beyond, where a task split by samples or
    heads runs larger blocks than counted: its diagonal tiles, a block/rows share of its
    work, bigger). A mask given as a tensor is not skipped by, every tile computed: no
    causal pair."""
    block, _ = flash.blocks(batch_heads, flash.CAUSAL_BLOCK_Q, keys, flash.Problem(1.0, True))
    return (2, 4, block)


def _mask(ctx: NodeContext) -> Tensor | None:
    """Input 3: a float tensor, or bools (a computed one, or a constant: 0/1 ids)."""
    if len(ctx.inputs) <= 3 or not ctx.input_names[3]:
        return None
    if ctx.inputs[3] is None and ctx.is_constant(3):
        return ctx.operand(3)
    return ctx.tensor(3)


def _problem(attrs: AttentionAttrs, args, keys: int) -> flash.Problem:
    origin = args.origin or (0, 0, 0, 0)
    dropout = None
    if attrs.dropout and args.random is not None:  # training: drop as the Dropout did
        full = (*args.full_shape[:3], keys)
        dropout = flash.Dropout(attrs.dropout, args.random, attrs.seed, origin[:3], full)
    return flash.Problem(
        attrs.scale, attrs.causal, origin[2], dropout=dropout, matmul_dtype=args.matmul_dtype
    )


def _mask_of(attrs: AttentionAttrs, inputs):
    """The mask as the kernels read it: additive floats, or bools (0/1 ids as they are)."""
    if not attrs.has_mask:
        return None
    mask = inputs[3]
    return mask != 0 if attrs.boolean_mask and mask.dtype.kind == "f" else mask


def forward(xp, attrs: AttentionAttrs, inputs, args):
    q, k, v = inputs[:3]
    mask = _mask_of(attrs, inputs)
    out, lse = flash.forward_with_lse(xp, q, k, v, mask, _problem(attrs, args, k.shape[2]))
    if args.stash is not None:  # the executor keeps it for the backward
        args.stash["lse"] = lse
    return out


def _backward_args(attrs: AttentionAttrs, inputs, args) -> tuple:
    """(q, k, v, mask, problem, wanted, lse): what both backwards take."""
    q, k, v = inputs[:3]
    mask = _mask_of(attrs, inputs)
    # a float mask is an additive bias: its gradient is the scores' (T5's relative
    # position bias trains through it); 0/1 ids take none
    bias = attrs.has_mask and mask.dtype.kind == "f" and wants(args, 3)
    wanted = flash.Wanted(wants(args, 0), wants(args, 1), wants(args, 2), bias)
    problem = _problem(attrs, args, k.shape[2])
    lse = args.stash.get("lse") if args.stash is not None else None
    return q, k, v, mask, problem, wanted, lse


def backward(xp, attrs: AttentionAttrs, inputs, output, grad_output, args):
    q, k, v, mask, problem, wanted, lse = _backward_args(attrs, inputs, args)
    grads = flash.backward(xp, q, k, v, mask, output, grad_output, problem, wanted, lse)
    return grads if attrs.has_mask else grads[:3]


def forward_streamed(xp, attrs: AttentionAttrs, inputs, args, blocks, arrive):
    """``forward`` with the keys and values taken block by block as they arrive (ring
    attention: ``OpDef.streams``), the partial outputs combined by log-sum-exp."""
    q, k, v = inputs[:3]
    mask = _mask_of(attrs, inputs)
    problem = _problem(attrs, args, k.shape[2])
    out, lse = flash.forward_streamed(xp, q, k, v, mask, problem, blocks, arrive)
    if args.stash is not None:
        args.stash["lse"] = lse
    return out


def backward_streamed(xp, attrs: AttentionAttrs, inputs, output, grad_output, args, blocks):
    """``backward`` block by block of keys: dQ summed over the blocks, each block's dK
    and dV its own."""
    q, k, v, mask, problem, wanted, lse = _backward_args(attrs, inputs, args)
    grads = flash.backward_streamed(
        xp, q, k, v, mask, output, grad_output, problem, blocks, wanted, lse
    )
    return grads if attrs.has_mask else grads[:3]


def workspace(attrs: AttentionAttrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """Beyond the buffers, the output and the gradients returned: a few score tiles at
    once (the scores, their exponentials, the causal triangle or the dropout's draws),
    the keys scaled once, and the rows' running statistics; in the backward one more
    tile (the scores' gradient) and each row's normalizer and rowsum(dO ∘ O).
    Tiles priced: 2 forward and 3 backward; 3 and 5 under a causal mask, whose small
    tiles leave more of the temporaries beside them. The kernels (``flash.py``) now hold
    two tiles a pass and a copy of V (forward) or of K and V (backward) widened by a
    column; these counts stand for that too, measured under tracemalloc at 0.91-1.22x
    of priced (tests/ops/test_attention_workspace.py asks 25 %)."""
    b, h, m, d = out_shape
    n = shapes[1][2]
    bq, bk = flash.blocks(b * h, m, n, flash.Problem(attrs.scale, attrs.causal))
    tile = b * h * bq * bk
    keys = math.prod(shapes[1])
    forward_tiles, backward_tiles = (3, 5) if attrs.causal else (2, 3)
    forward_bytes = (forward_tiles * tile + keys + b * h * bq * (d + 2)) * itemsize
    return forward_bytes, (backward_tiles * tile + keys + 2 * b * h * m) * itemsize


def streamed_workspace(attrs: AttentionAttrs, shapes, out_shape, itemsize: int, span: int):
    """``workspace`` of a streamed task (ring attention), its widest span of keys
    ``span``: each span's call holds what a call on those keys alone does (copies of
    the span's keys and values, not of all), and besides it the forward the running
    output, the backward the summed dQ and the span's dK and dV."""
    q, k, v = shapes[:3]
    part = [q, (*k[:2], span, k[3]), (*v[:2], span, v[3]), *shapes[3:]]
    forward_bytes, backward_bytes = workspace(attrs, part, out_shape, itemsize)
    running = math.prod(out_shape) * itemsize
    grads = (math.prod(q) + math.prod(part[1]) + math.prod(part[2])) * itemsize
    return forward_bytes + running, backward_bytes + grads


def _causal_mask(size: int) -> C:
    values = [0.0 if j <= i else -1e9 for i in range(size) for j in range(size)]
    return C(values, "float32", shape=(1, 1, size, size))


ATTENTION = OpDef(
    name="Attention",
    versions=(23, 24),
    convert=convert,
    forward=forward,
    backward=backward,
    workspace=workspace,
    saves=Saved(inputs=None, output=True),
    random=True,  # the fused dropout (tests/ops/test_attention.py)
    stashes=True,  # each row's log-sum-exp, from the forward to the backward
    # K and V by blocks of keys along the queries' split (ring attention): dims m, k
    streams=Streamed((1, 2), 2, 2, 4, forward_streamed, backward_streamed, streamed_workspace),
    cases=(
        case("attention_plain", "Attention", X(2, 2, 5, 3), W(2, 2, 6, 3), W(2, 2, 6, 4), opset=23),
        case(
            "attention_grouped_causal",
            "Attention",
            X(2, 4, 5, 3),
            W(2, 2, 5, 3),
            W(2, 2, 5, 3),
            opset=23,
            is_causal=1,
        ),
        case(
            "attention_mask_scale",
            "Attention",
            X(1, 2, 4, 3),
            W(1, 2, 4, 3),
            W(1, 2, 4, 2),
            _causal_mask(4),
            opset=23,
            scale=0.7,
        ),
        case(
            "attention_no_mask_given",
            "Attention",
            X(1, 1, 3, 2),
            W(1, 1, 4, 2),
            W(1, 1, 4, 2),
            NONE,
            opset=23,
        ),
    ),
)

DEFINITIONS = (ATTENTION,)
