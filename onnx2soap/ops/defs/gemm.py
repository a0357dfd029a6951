"""Gemm: Y = alpha * A' @ B' + beta * C, with A' = A.T if transA, B' = B.T if transB.

The contraction dim ``ci`` splits too (``LoopNest.partial_dims``, Megatron's row-parallel
linear): each task computes alpha * A'_k @ B'_k from its slices and the partial tiles
are summed. ``beta * C`` belongs to the sum once: the task whose slice of ``ci`` starts
at 0 adds it, and only that task gives C a gradient (the others zeros, which the
gradients' sum over the tasks that read the same C adds harmlessly).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from onnx2soap.ir import Operand, identity
from onnx2soap.ops.base import OpDef, Saved, W, X, case, wants
from onnx2soap.ops.context import NodeContext, broadcast_operand, broadcast_shape, make_op
from onnx2soap.ops.kernel_util import matmul, unbroadcast

_CI = 2  # the contraction dim's index in the nest


@dataclass(frozen=True)
class GemmAttrs:
    alpha: float = 1.0
    beta: float = 1.0
    trans_a: bool = False
    trans_b: bool = False


def convert(ctx: NodeContext, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    a, b, c = ctx.tensor(0), ctx.tensor(1), ctx.optional(2)
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ctx.fail(f"A and B must be 2-D, got {list(a.shape)} and {list(b.shape)}")
    m, k = a.shape[::-1] if transA else a.shape
    kb, n = b.shape[::-1] if transB else b.shape
    if k != kb:
        raise ctx.fail(f"A' {[m, k]} and B' {[kb, n]} do not multiply")
    N, CO, CI = 0, 1, _CI  # dims: rows (n), output features (co), reduction (ci)
    a_axes = (identity(CI), identity(N)) if transA else (identity(N), identity(CI))
    b_axes = (identity(CO), identity(CI)) if transB else (identity(CI), identity(CO))
    operands = [Operand(a.name, a_axes), Operand(b.name, b_axes)]
    if c is not None:
        # C broadcasts *to* Y (unidirectionally): [N] or [M, 1] are fine, [11] is not.
        if len(c.shape) > 2 or broadcast_shape(ctx, [c.shape, (m, n)]) != (m, n):
            raise ctx.fail(f"C {list(c.shape)} does not broadcast to Y {[m, n]}")
        operands.append(broadcast_operand(c, (m, n)))
    attrs = GemmAttrs(float(alpha), float(beta), bool(transA), bool(transB))
    dims = [("n", m), ("co", n), ("ci", k)]
    op = make_op(ctx, operands, attrs, dims, (N, CO), 2)
    return replace(op, nest=replace(op.nest, partial_dims=(CI,)))


def _first_slice(args) -> bool:
    """Whether the task holds the start of the contraction (every task that does not
    split it; the whole op where the box is not given): it alone adds C."""
    return not args.box or args.box[_CI][0] == 0


def forward(xp, attrs: GemmAttrs, inputs, args):
    a, b = inputs[0], inputs[1]
    a = a.T if attrs.trans_a else a
    b = b.T if attrs.trans_b else b
    y = matmul(xp, a, b, args.matmul_dtype)
    if attrs.alpha != 1.0:
        y *= attrs.alpha
    if len(inputs) > 2 and _first_slice(args):
        y += attrs.beta * inputs[2]
    return y


def backward(xp, attrs: GemmAttrs, inputs, output, grad_output, args):
    a, b = inputs[0], inputs[1]
    g = grad_output * attrs.alpha if attrs.alpha != 1.0 else grad_output
    # dA' = g B'^T, dB' = A'^T g (A' (M, K), B' (K, N)); a transposed operand takes the
    # transposed product, computed directly so that the result is contiguous in the
    # buffer's layout. Each of A and B is read for the other's gradient only (it may be
    # released).
    low = args.matmul_dtype
    grad_a = grad_b = None
    if wants(args, 0):
        tb = b.T if attrs.trans_b else b
        grad_a = matmul(xp, tb, g.T, low) if attrs.trans_a else matmul(xp, g, tb.T, low)
    if wants(args, 1):
        ta = a.T if attrs.trans_a else a
        grad_b = matmul(xp, g.T, ta, low) if attrs.trans_b else matmul(xp, ta.T, g, low)
    grads = [grad_a, grad_b]
    if len(inputs) > 2:
        c = inputs[2]
        if _first_slice(args):
            # beta 1 (every linear layer): no tile-sized product before the sum
            scaled = grad_output if attrs.beta == 1.0 else grad_output * attrs.beta
            grads.append(unbroadcast(xp, scaled, c.shape))
        else:
            grads.append(xp.zeros(c.shape, dtype=grad_output.dtype))
    return tuple(grads)


GEMM = OpDef(
    name="Gemm",
    versions=(13,),
    convert=convert,
    forward=forward,
    backward=backward,
    # A and B, each only where the other takes a gradient; C's shape only
    saves=Saved(inputs=(0, 1), output=False, only_for=((0, (1,)), (1, (0,)))),
    cases=(
        case("gemm", "Gemm", X(4, 3), W(3, 5)),
        case("gemm_bias1d", "Gemm", X(4, 3), W(3, 5), W(5)),
        case("gemm_bias2d", "Gemm", X(4, 3), W(3, 5), W(4, 5), alpha=0.5, beta=2.0),
        case("gemm_bias_col", "Gemm", X(4, 3), W(5, 3), W(4, 1), transB=1),
        case("gemm_trans", "Gemm", X(3, 4), W(5, 3), W(1, 5), transA=1, transB=1, alpha=-1.5),
    ),
)

DEFINITIONS = (GEMM,)
