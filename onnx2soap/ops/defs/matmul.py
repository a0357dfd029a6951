"""MatMul: numpy.matmul semantics for operands of rank >= 2 (rank 1 is refused): batch
axes broadcast, and an operand may have fewer of them than the output.

The contraction dim ``ci`` splits too (``LoopNest.partial_dims``, Megatron's row-parallel
linear): each task multiplies its slices of both operands, a partial product, and the
partial tiles are summed; the kernels need nothing for it, since a task's buffers hold
exactly its slices and its backward gets the whole tile's gradient.

``transpose_b`` (onnx2soap's own attribute, written only by the importer in its fused
domain, ``importer/transposed.py``): B is stored [.., co, ci] and read transposed, as a
tied LM head reads the embedding (``x @ Eᵀ``): BLAS multiplies by the transposed view,
so no step makes (and differentiates) a transposed copy of the weight."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from onnx2soap.ir import AxisMap, Broadcast, Operand, Tensor, identity
from onnx2soap.ops.base import OpDef, Saved, W, X, case, wants
from onnx2soap.ops.context import NodeContext, broadcast_shape, make_op
from onnx2soap.ops.kernel_util import matmul, unbroadcast


@dataclass(frozen=True)
class MatMulAttrs:
    transpose_b: bool = False  # B stored [.., co, ci]


def convert(ctx: NodeContext, *, transpose_b=0):
    a, b = ctx.tensor(0), ctx.tensor(1)
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ctx.fail(
            f"both operands must have rank >= 2 (got {list(a.shape)} and {list(b.shape)})"
        )
    transposed = bool(transpose_b)
    b_rows, b_cols = (b.shape[-1], b.shape[-2]) if transposed else b.shape[-2:]
    if a.shape[-1] != b_rows:
        raise ctx.fail(f"{list(a.shape)} @ {list(b.shape)}: inner dims differ")
    batch = broadcast_shape(ctx, [a.shape[:-2], b.shape[:-2]])
    out = (*batch, a.shape[-2], b_cols)
    nb = len(out) - 2
    batch_names = ("n", *(f"b{i}" for i in range(1, nb)))[:nb]
    row_name = "m" if nb else "n"
    dims = [*zip(batch_names, out[:nb], strict=True), (row_name, out[-2]), ("co", out[-1])]
    dims.append(("ci", a.shape[-1]))
    M, CO, CI = nb, nb + 1, nb + 2

    def batch_axes(t: Tensor) -> list[AxisMap]:
        lead = nb - (len(t.shape) - 2)
        return [
            Broadcast() if size == 1 and out[lead + i] != 1 else identity(lead + i)
            for i, size in enumerate(t.shape[:-2])
        ]

    inner = (identity(CO), identity(CI)) if transposed else (identity(CI), identity(CO))
    operands = [
        Operand(a.name, (*batch_axes(a), identity(M), identity(CI))),
        Operand(b.name, (*batch_axes(b), *inner)),
    ]
    op = make_op(ctx, operands, MatMulAttrs(transposed), dims, range(nb + 2), 2)
    if not (a.dtype.is_float and b.dtype.is_float):
        return op  # integer products would be summed at int64 width: nothing gained
    return replace(op, nest=replace(op.nest, partial_dims=(CI,)))


def _b(xp, attrs: MatMulAttrs, b):
    """B as the product reads it: [.., ci, co] (a view where stored transposed)."""
    return xp.swapaxes(b, -1, -2) if attrs.transpose_b else b


def _product(xp, a, b, dtype):
    """a @ b; batched rows times a 2-D B as one product over all their rows ([rows, ci]
    @ [ci, co], a view of contiguous rows), not one a sample: numpy calls BLAS once, on
    the larger matrix it runs faster on (a GPT's LM head on one CPU thread: 5 %)."""
    if b.ndim == 2 and a.ndim > 2 and a.flags.c_contiguous:
        rows = matmul(xp, a.reshape(-1, a.shape[-1]), b, dtype)
        return rows.reshape(*a.shape[:-1], b.shape[-1])
    return matmul(xp, a, b, dtype)


def forward(xp, attrs, inputs, args):
    a, b = inputs
    return _product(xp, a, _b(xp, attrs, b), args.matmul_dtype)


def _reduced(xp, product, shape):
    """A product is a fresh array already: it is the gradient as it is where its operand
    does not broadcast (a copy would hold a second weight-sized array at the peak)."""
    return product if product.shape == tuple(shape) else unbroadcast(xp, product, shape)


def backward(xp, attrs, inputs, output, grad_output, args):
    a, b = inputs  # each is read for the other's gradient only (it may be released)
    grad_a = grad_b = None
    if wants(args, 0):
        bt = b if attrs.transpose_b else xp.swapaxes(b, -1, -2)  # [.., co, ci]
        grad_a = _product(xp, grad_output, bt, args.matmul_dtype)
        grad_a = _reduced(xp, grad_a, a.shape)
    if wants(args, 1):
        grad_b = _weight_gradient(xp, attrs, a, b, grad_output, args.matmul_dtype)
    return grad_a, grad_b


def _weight_gradient(xp, attrs: MatMulAttrs, a, b, grad_output, dtype):
    """aᵀ g in B's stored layout (g a for a transposed B), summed over what B broadcasts."""
    if b.ndim == 2 and a.ndim > 2:
        # a weight read by every sample and position: one product over all their rows
        # (Σ_batch aᵀ g), not a product a sample summed afterwards
        rows_a = a.reshape(-1, a.shape[-1])
        rows_g = grad_output.reshape(-1, grad_output.shape[-1])
        if attrs.transpose_b:
            return matmul(xp, rows_g.T, rows_a, dtype)
        return matmul(xp, rows_a.T, rows_g, dtype)
    if attrs.transpose_b:
        grad = matmul(xp, xp.swapaxes(grad_output, -1, -2), a, dtype)
    else:
        grad = matmul(xp, xp.swapaxes(a, -1, -2), grad_output, dtype)
    return _reduced(xp, grad, b.shape)


def workspace(attrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """The backward's raw products of the operands that broadcast, alive until it
    returns: such a gradient is first computed over the output's batch axes, then summed
    over the ones its operand broadcasts. An operand that does not broadcast gets its
    product as its gradient (counted with the fresh gradients, not here), and so does a
    2-D weight under batched data (one product over all the rows)."""
    (m, k), n = shapes[0][-2:], shapes[1][-2 if attrs.transpose_b else -1]
    batch = math.prod(out_shape[:-2])
    raw_a = batch * m * k
    raw_b = k * n if len(shapes[1]) == 2 and len(shapes[0]) > 2 else batch * k * n
    held = (raw_a if math.prod(shapes[0]) != raw_a else 0) + (
        raw_b if math.prod(shapes[1]) != raw_b else 0
    )
    return 0, held * itemsize


MATMUL = OpDef(
    name="MatMul",
    versions=(13,),
    convert=convert,
    forward=forward,
    backward=backward,
    workspace=workspace,
    # each operand multiplies the other's gradient: a linear's data input is not kept
    # for its weight, nor the weight for data, which takes no gradient
    saves=Saved(inputs=None, output=False, only_for=((0, (1,)), (1, (0,)))),
    cases=(
        case("matmul_2d", "MatMul", X(4, 3), W(3, 5)),
        case("matmul_weight_2d", "MatMul", X(2, 3, 4, 5), W(5, 6)),
        case("matmul_batch_bcast", "MatMul", X(2, 1, 4, 5), W(3, 5, 6)),
        case("matmul_weight_batch", "MatMul", X(2, 4, 5), W(3, 1, 5, 6)),
    ),
    # transpose_b is tested in tests/importer/test_transposed.py: the fusion writes it
)

DEFINITIONS = (MATMUL,)
