"""What a converter sees of one node, and the helpers that build loop nests.

Converters compute the output shape from the op's definition (ONNX shape inference is
only a cross-check: before opset 22 it keeps ceil_mode pooling windows that start in the
end padding, which onnxruntime and PyTorch drop).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from onnx2soap.errors import ModelError
from onnx2soap.ir import (
    AxisMap,
    BatchAt,
    Broadcast,
    DType,
    IterDim,
    LoopNest,
    Op,
    Operand,
    Tensor,
    TensorRole,
    identity,
)


@dataclass(frozen=True)
class NodeContext:
    """One node. ``inputs[i]`` is None for an omitted optional input or an integer
    constant; a float constant is a tensor of role CONSTANT. ``constants[i]`` holds the
    value of every constant input. ``outputs`` are the node's output names ('' where an
    optional output is omitted)."""

    name: str
    op_type: str
    inputs: tuple[Tensor | None, ...]
    constants: tuple[np.ndarray | None, ...]
    outputs: tuple[str, ...]
    input_names: tuple[str, ...] = ()
    literal: tuple[bool, ...] = ()  # per input: a constant written in the file
    batch: int = 1  # the bound batch size
    # per input: where the batch lies in it (empty for weights, constants and what is
    # computed from them alone)
    batches: tuple[frozenset[BatchAt], ...] = ()

    @property
    def output(self) -> str:
        return self.outputs[0]

    def fail(self, what: str) -> ModelError:
        return ModelError(f"node '{self.name}' ({self.op_type}): {what}")

    def tensor(self, i: int) -> Tensor:
        t = self.optional(i)
        if t is None:
            raise self.fail(f"input {i} must be a tensor computed at run time or a weight")
        return t

    def optional(self, i: int) -> Tensor | None:
        """Input ``i``, or None if it is omitted. An integer constant given there is
        refused: dropping it would compute something else."""
        t = self.inputs[i] if i < len(self.inputs) else None
        if t is None and self.is_constant(i):
            raise self.fail(
                f"input {i} is an integer constant; a float tensor (computed, a weight or "
                "a float constant) is needed there"
            )
        return t

    def operand(self, i: int) -> Tensor:
        """Input ``i`` as an operand tensor, an integer constant included (compared with
        ids, say): it becomes an int64 constant tensor the op reads like any other."""
        t = self.inputs[i] if i < len(self.inputs) else None
        if t is not None:
            return t
        value = self.constants[i] if i < len(self.constants) else None
        if value is None or i >= len(self.input_names):
            raise self.fail(
                f"input {i} must be a tensor computed at run time, a weight or a constant"
            )
        return Tensor(self.input_names[i], tuple(value.shape), DType.INT64, TensorRole.CONSTANT)

    def is_literal(self, i: int) -> bool:
        """Input ``i`` is a constant the file states (not folded from shapes at the bound
        batch): a batch size in it was fixed at export time."""
        return i < len(self.literal) and self.literal[i]

    def batch_at(self, i: int) -> frozenset[BatchAt]:
        """Where the batch lies in input ``i`` (traced through the ops before this one)."""
        return self.batches[i] if i < len(self.batches) else frozenset()

    def is_constant(self, i: int) -> bool:
        return i < len(self.constants) and self.constants[i] is not None

    def constant(self, i: int) -> np.ndarray:
        c = self.constants[i] if i < len(self.constants) else None
        if c is None:
            raise self.fail(f"input {i} must be a constant known when the model is loaded")
        return c

    def optional_constant(self, i: int) -> np.ndarray | None:
        """Constant input ``i``, None if omitted; refused if computed at run time."""
        given = i < len(self.inputs) and (self.inputs[i] is not None or self.is_constant(i))
        if given and not self.is_constant(i):
            raise self.fail(f"input {i} must be a constant known when the model is loaded")
        return self.constants[i] if i < len(self.constants) else None


def one_kind(ctx: NodeContext, tensors: Sequence[Tensor], what: str = "operands") -> bool:
    """Whether ``tensors`` are integers (ids, masks and positions computed from the data,
    or integer constants: no gradient), else floats. ONNX gives them one element type; the
    IR's only mix is a bool constant (a 0/1 float) among ids, refused here by name."""
    ints = [not t.dtype.is_float for t in tensors]
    if any(ints) and not all(ints):
        kinds = ", ".join(f"'{t.name}' {t.dtype.value}" for t in tensors)
        raise ctx.fail(f"{what} mix floats and integers ({kinds}); one element type is needed")
    return all(ints)


def float_attribute(value) -> float:
    """A float attribute, or the 0-d float64 tensor the importer's fusions write where a
    float64 model's constant must stay exact (ONNX's float attributes are float32)."""
    if isinstance(value, onnx.TensorProto):
        return float(numpy_helper.to_array(value))
    return float(value)


def text(value: str | bytes) -> str:
    """A string attribute as onnx.helper returns it (bytes) or as a default (str)."""
    return value.decode() if isinstance(value, bytes) else value


def axis_names(rank: int) -> tuple[str, ...]:
    names = {
        0: (),
        1: ("n",),
        2: ("n", "f"),
        3: ("n", "c", "l"),
        4: ("n", "c", "h", "w"),
        5: ("n", "c", "d", "h", "w"),
    }
    return names.get(rank, ("n", *(f"a{i}" for i in range(1, rank))))


def spatial_names(count: int) -> tuple[str, ...]:
    return axis_names(count + 2)[2:]


def make_op(
    ctx: NodeContext,
    operands: Iterable[Operand],
    attrs: object,
    dims: Iterable[tuple[str, int]],
    out_dims: Iterable[int | None],
    flops_per_point: int,
    *,
    output: str | None = None,
    name: str | None = None,
    is_loss: bool = False,
    dtype: DType | None = None,
) -> Op:
    operands = tuple(operands)
    nest = LoopNest(
        dims=tuple(IterDim(n, s) for n, s in dims),
        inputs=operands,
        out_dims=tuple(out_dims),
        flops_per_point=flops_per_point,
    )
    return Op(
        name=name or ctx.name,
        type=ctx.op_type,
        inputs=tuple(o.tensor for o in operands),
        output=output or ctx.output,
        attrs=attrs,
        nest=nest,
        is_loss=is_loss,
        dtype=dtype,
    )


def output_tensor(op: Op, tensors: dict[str, Tensor]) -> Tensor:
    """The op's output, its shape from the loop nest, its dtype the first float input's
    (an op of integers only, say a reshape of token ids, gives integers)."""
    shape = tuple(1 if d is None else op.nest.dims[d].size for d in op.nest.out_dims)
    dtypes = [tensors[t].dtype for t in op.inputs]
    dtype = op.dtype or next((d for d in dtypes if d.is_float), dtypes[0])
    batched = any(tensors[t].batched for t in op.inputs)
    return Tensor(op.output, shape, dtype, TensorRole.ACTIVATION, batched)


def identity_axes(rank: int, first: int = 0) -> tuple[AxisMap, ...]:
    return tuple(identity(first + i) for i in range(rank))


def broadcast_operand(t: Tensor, out_shape: Sequence[int]) -> Operand:
    """numpy-style multidirectional broadcasting: align right, size-1 axes broadcast."""
    lead = len(out_shape) - len(t.shape)
    axes: list[AxisMap] = []
    for i, size in enumerate(t.shape):
        d = lead + i
        axes.append(Broadcast() if size == 1 and out_shape[d] != 1 else identity(d))
    return Operand(t.name, tuple(axes))


def broadcast_shape(ctx: NodeContext, shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in np.broadcast_shapes(*(tuple(s) for s in shapes)))
    except ValueError as e:
        raise ctx.fail(f"shapes {[list(s) for s in shapes]} do not broadcast") from e


def elementwise(
    ctx: NodeContext, operands: Sequence[Tensor], attrs: object, flops_per_point: int
) -> Op:
    """An op whose output point reads the same point of every (broadcast) operand."""
    shape = broadcast_shape(ctx, [t.shape for t in operands])
    dims = list(zip(axis_names(len(shape)), shape, strict=True))
    ops = [broadcast_operand(t, shape) for t in operands]
    return make_op(ctx, ops, attrs, dims, range(len(shape)), flops_per_point)
