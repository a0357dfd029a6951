"""Turn prepared ONNX nodes into a training ``Graph``: roles, converters, loss."""

from __future__ import annotations

import inspect
import math
from dataclasses import replace

import onnx

from onnx2soap.errors import ModelError
from onnx2soap.importer.prepare import Prepared, compact
from onnx2soap.importer.stats_order import side_by_side
from onnx2soap.ir import (
    BatchAt,
    Binding,
    DType,
    Graph,
    LossKind,
    Op,
    Tensor,
    TensorRole,
    batch_dims,
    output_batch,
)
from onnx2soap.ops import OpDef, registry
from onnx2soap.ops.context import NodeContext, output_tensor
from onnx2soap.ops.defs.losses import LossAttrs, cross_entropy_op, mse_op

_DTYPES = {
    onnx.TensorProto.FLOAT: DType.FLOAT32,
    onnx.TensorProto.DOUBLE: DType.FLOAT64,
    onnx.TensorProto.INT64: DType.INT64,
    # The IR has no bools: a bool input (an attention mask) is fed as 0/1 ids.
    onnx.TensorProto.BOOL: DType.INT64,
}


def _dtype(p: Prepared, name: str) -> DType:
    elem = p.types[name].elem_type
    if elem not in _DTYPES:
        raise ModelError(
            f"{p.path}: tensor '{name}' has element type "
            f"{onnx.TensorProto.DataType.Name(elem)}; supported: float, double, int64"
        )
    return _DTYPES[elem]


def _unfolded_shape(p: Prepared, node: onnx.NodeProto) -> bool:
    """A Shape node left because shape inference gave its input no static shape: not an
    unsupported op, but the trace of a node before it whose shapes do not fit (a shape
    written in the file for another batch), which converting that node names."""
    return (
        node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.input[0] not in p.types
    )


def _definitions(p: Prepared) -> list[OpDef | None]:
    """The definition reading each node; every node without one is listed in one error
    (but unfolded Shape nodes: see ``_unfolded_shape``)."""
    reg = registry()
    found = [reg.for_node(n.op_type, n.domain, p.opset) for n in p.nodes]
    bad = [
        n for n, d in zip(p.nodes, found, strict=True) if d is None and not _unfolded_shape(p, n)
    ]
    if bad:
        listed = ", ".join(
            f"'{n.name or n.output[0]}' ({n.op_type}, domain {n.domain or 'ai.onnx'}, "
            f"opset {p.opsets.get(n.domain or 'ai.onnx', '?')})"
            for n in bad
        )
        raise ModelError(
            f"{p.path}: {len(bad)} unsupported node{'s' if len(bad) > 1 else ''}: {listed}; "
            f"supported ops: {reg.listing()}"
        )
    return found


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _finite(value: object) -> bool:
    """No float attribute of any op means anything as NaN or infinity (alpha, epsilon,
    momentum, ratios): such a model was broken on the way, and would train to NaN."""
    values = value if isinstance(value, list | tuple) else [value]
    return all(math.isfinite(v) for v in values if isinstance(v, float))


TORCH_IGNORE_INDEX = -100  # what torch.nn.CrossEntropyLoss ignores by default


class _Builder:
    """Walks the nodes once, giving every tensor its role and every node its ``Op``."""

    def __init__(self, p: Prepared) -> None:
        self.p = p
        self.tensors: dict[str, Tensor] = {}
        self.aliases: dict[str, str] = {}  # Identity outputs that are just a weight
        self.names: set[str] = set()  # op names given so far
        self.ops: list[Op] = []
        self.bound: set[str] = set()  # tensors read by the ops converted so far
        self.loss_types = {d.name for d in registry().onnx_ops() if d.is_loss}
        self._read: set[str] | None = None  # every name a node or the graph reads, once
        # Where the batch lies in each tensor computed from the data (axis 0 of every
        # graph input), traced through the access maps as ops are converted.
        self.where: dict[str, frozenset[BatchAt]] = {
            name: frozenset({BatchAt(0)}) for name in p.graph_inputs
        }
        for name in p.graph_inputs:
            _dtype(p, name)  # an input of a type onnx2soap cannot feed is refused up front

    def _add(self, name: str, role: TensorRole) -> Tensor:
        if name not in self.p.types:
            raise ModelError(f"{self.p.path}: tensor '{name}' has no static shape after inference")
        batched = role in (TensorRole.INPUT, TensorRole.LABELS)
        t = Tensor(name, self.p.types[name].shape, _dtype(self.p, name), role, batched)
        self.tensors[name] = t
        return t

    def _operand(self, node: onnx.NodeProto, name: str, position: int) -> Tensor | None:
        """The tensor node input ``name`` is; None if omitted or an integer constant
        (converters read those with ``ctx.constant``)."""
        name = self.aliases.get(name, name)
        if not name:
            return None
        if name in self.tensors:
            return self.tensors[name]
        if name in self.p.constants:
            value = self.p.constants[name]
            distinct = compact(value).size  # a broadcast one holds fewer
            distinct = distinct if distinct < value.size else 0
            if value.dtype.kind == "b":  # no bools in the IR: a mask is a 0/1 float constant
                t = Tensor(name, tuple(value.shape), DType.FLOAT32, TensorRole.CONSTANT)
                self.tensors[name] = replace(t, distinct=distinct)
                return self.tensors[name]
            if value.dtype.kind != "f":
                return None
            t = self._add(name, TensorRole.CONSTANT)
            self.tensors[name] = replace(t, distinct=distinct)
            return self.tensors[name]
        if name in self.p.float_initializers:
            # A 0-d float initializer is a constant the exporter stored (a scale, an
            # epsilon), not a parameter: trained, it would drift from what the model means.
            # So is a buffer torch.export recorded (rotary frequencies): torch never
            # trains it.
            scalar = self.p.float_initializers[name].ndim == 0
            fixed = scalar or name in self.p.buffers
            return self._add(name, TensorRole.CONSTANT if fixed else TensorRole.WEIGHT)
        if name in self.p.graph_inputs:
            # Every graph input is batched along axis 0: the loss's targets (its input 1),
            # or data.
            labels = node.op_type in self.loss_types and position == 1
            role = TensorRole.LABELS if labels else TensorRole.INPUT
            return self._add(name, role)
        raise ModelError(f"{self.p.path}: node '{node.name}' reads '{name}', which nothing writes")

    def _constant_value(self, name: str, tensor: Tensor | None):
        """The value of a constant input: a folded constant, or a float initializer that
        is a constant (a 0-d one); None for anything computed or trained."""
        if name in self.p.constants:
            return self.p.constants[name]
        if tensor is not None and tensor.role is TensorRole.CONSTANT:
            return self.p.float_initializers[tensor.name].read()  # a 0-d one: a scalar
        return None

    def _batch_at(self, t: Tensor | None) -> frozenset[BatchAt]:
        """Where the batch lies in ``t`` (nowhere in weights and constants)."""
        return self.where.get(t.name, frozenset()) if t is not None else frozenset()

    def _unique_name(self, node: onnx.NodeProto) -> str:
        """The op's name: the node's, made unique (ONNX does not require unique names)."""
        base = node.name or node.output[0]
        name, k = base, 1
        while name in self.names:
            name, k = f"{base}_{k}", k + 1
        self.names.add(name)
        return name

    def _extra_outputs(self, node: onnx.NodeProto, name: str, used: int) -> None:
        """Refuse outputs past the first ``used`` that a node or the graph reads."""
        extra = [o for o in node.output[used:] if o]
        if not extra:
            return
        if self._read is None:  # made once: per node it made the import quadratic
            self._read = {i for n in self.p.nodes for i in n.input} | set(self.p.graph_outputs)
        read = self._read
        if any(o in read for o in extra):
            raise ModelError(
                f"{self.p.path}: node '{name}' ({node.op_type}): only its first "
                f"{'output is' if used == 1 else f'{used} outputs are'} supported, but "
                f"{[o for o in extra if o in read]} are used"
            )

    def convert(self, node: onnx.NodeProto, definition: OpDef) -> None:
        name = self._unique_name(node)
        inputs = tuple(self._operand(node, name, k) for k, name in enumerate(node.input))
        if node.op_type == "Identity" and inputs[0] and inputs[0].role is TensorRole.WEIGHT:
            self.aliases[node.output[0]] = inputs[0].name
            return
        ctx = NodeContext(
            name=name,
            op_type=node.op_type,
            inputs=inputs,
            constants=tuple(
                self._constant_value(i, t) for i, t in zip(node.input, inputs, strict=True)
            ),
            outputs=tuple(node.output),
            input_names=tuple(node.input),
            literal=tuple(i in self.p.literal for i in node.input),
            batch=self.p.batch,
            batches=tuple(self._batch_at(t) for t in inputs),
        )
        attrs = _attributes(node)
        known = [k for k in inspect.signature(definition.convert).parameters if k != "ctx"]
        unknown = sorted(set(attrs) - set(known))
        if unknown:
            error = ctx.fail(f"attributes {unknown} are not in the spec; known: {known}")
            raise ModelError(f"{self.p.path}: {error}")
        nonfinite = sorted(k for k, v in attrs.items() if not _finite(v))
        if nonfinite:
            error = ctx.fail(f"attributes {nonfinite} are NaN or infinite; finite numbers only")
            raise ModelError(f"{self.p.path}: {error}")
        try:
            made = definition.convert(ctx, **attrs)
        except ModelError as e:
            raise ModelError(f"{self.p.path}: {e}") from e
        ops = made if isinstance(made, tuple) else (made,)
        if self._passes_input(ops, definition):
            self.aliases[node.output[0]] = ops[0].inputs[0]
            return
        self._extra_outputs(node, name, len(ops))
        for op in ops:
            self._register_int_constants(op)
            self._bind(op)
            out = output_tensor(op, self.tensors)
            self._cross_check(node, op, out)
            self._refuse_cut_gradient(op, out)
            self.tensors[out.name] = out
            self.ops.append(op)
            operands = [self._batch_at(self.tensors[o.tensor]) for o in op.nest.inputs]
            carried = batch_dims(op.nest, operands, self.p.batch)
            self.where[op.output] = output_batch(op.nest, carried)

    def _passes_input(self, ops: tuple[Op, ...], definition: OpDef) -> bool:
        """Whether the node's one op outputs its activation input 0 unchanged
        (``OpDef.passes_input``): a copy nothing needs, which every step would make and
        a reader could keep for its backward beside the original."""
        if len(ops) != 1 or definition.passes_input is None:
            return False
        op = ops[0]
        source = self.tensors.get(op.inputs[0]) if op.inputs else None
        if source is None or source.role is not TensorRole.ACTIVATION:
            return False
        same = output_tensor(op, self.tensors).dtype == source.dtype
        return same and definition.passes_input(op.attrs)

    def _register_int_constants(self, op: Op) -> None:
        """Integer constants an op reads as operands (``ctx.operand``) become tensors."""
        for name in op.inputs:
            if name not in self.tensors and name in self.p.constants:
                value = self.p.constants[name]
                self.tensors[name] = Tensor(name, value.shape, DType.INT64, TensorRole.CONSTANT)

    def _refuse_cut_gradient(self, op: Op, out: Tensor) -> None:
        """An op that computes integers runs no backward (ids take no gradient), so it may
        read no float tensor computed at run time: that tensor's producer would wait for a
        gradient from it. Integers are computed from ids, masks and constants."""
        if out.dtype.is_float:
            return
        for t in op.inputs:
            read = self.tensors[t]
            if read.dtype.is_float and read.role is TensorRole.ACTIVATION:
                raise ModelError(
                    f"{self.p.path}: node '{op.name}' ({op.type}) computes integers from "
                    f"'{t}', a float tensor computed at run time; integers computed from "
                    "ids, masks and constants are supported (no gradient flows through them)"
                )

    def _bind(self, op: Op) -> None:
        """Give the float initializers an op reads as constants or state their role."""
        roles = {Binding.CONSTANT: TensorRole.CONSTANT, Binding.STATE: TensorRole.STATE}
        for operand in op.nest.inputs:
            t = self.tensors[operand.tensor]
            want = roles.get(operand.binding, TensorRole.WEIGHT)
            if t.role is want or operand.binding is Binding.READ:
                continue
            if t.role is not TensorRole.WEIGHT or t.name in self.bound:
                raise ModelError(
                    f"{self.p.path}: node '{op.name}' ({op.type}): input '{t.name}' must be a "
                    f"float initializer used only as its {want.value}, but it is "
                    f"{'also read elsewhere' if t.name in self.bound else f'a {t.role.value}'}"
                )
            self.tensors[t.name] = Tensor(t.name, t.shape, t.dtype, want)
        self.bound.update(o.tensor for o in op.nest.inputs)

    def _cross_check(self, node: onnx.NodeProto, op: Op, out: Tensor) -> None:
        """Our shape must be ONNX's wherever ONNX saw the same input shapes, except for
        ceil_mode pools, where ONNX before opset 22 keeps a window onnxruntime drops."""
        inferred = self.p.types.get(out.name)
        same_inputs = all(
            self.p.types.get(t) is not None and self.p.types[t].shape == self.tensors[t].shape
            for t in op.inputs
        )
        ceil_pool = any(a.name == "ceil_mode" and a.i for a in node.attribute)
        if inferred and same_inputs and not ceil_pool and inferred.shape != out.shape:
            raise ModelError(
                f"{self.p.path}: node '{op.name}' ({node.op_type}): output shape "
                f"{list(out.shape)} disagrees with ONNX shape inference {list(inferred.shape)}"
            )


def _prune(ops: list[Op], keep: str) -> list[Op]:
    """Drop ops that neither the loss nor the output depends on."""
    needed, kept = {keep}, []
    for op in reversed(ops):
        if op.output in needed:
            kept.append(op)
            needed.update(op.inputs)
    return kept[::-1]


def _attach_loss(b: _Builder, output: Tensor, loss: LossKind) -> Op:
    name = "loss"
    while name in b.tensors or name in b.names:
        name += "_"
    b.names.add(name)
    labels_name = "labels"
    while labels_name in b.tensors:
        labels_name += "_"
    if loss is LossKind.CROSS_ENTROPY:
        if len(output.shape) < 2:
            raise ModelError(
                f"{b.p.path}: cross-entropy needs a [batch, ..., classes] output, but "
                f"'{output.name}' is {list(output.shape)} (choose --loss mse or none)"
            )
        # torch's CrossEntropyLoss over the last axis: logits [N, C] with labels [N], or
        # token logits [N, T, C] with labels [N, T]; the mean over every label position,
        # label -100 ignored.
        labels = Tensor(labels_name, output.shape[:-1], DType.INT64, TensorRole.LABELS, True)
        ctx = NodeContext(name, "SoftmaxCrossEntropyLoss", (output, labels), (None, None), (name,))
        attrs = LossAttrs(ignore_index=TORCH_IGNORE_INDEX, class_axis=len(output.shape) - 1)
        op = cross_entropy_op(ctx, output, labels, attrs)
    else:
        labels = Tensor(labels_name, output.shape, output.dtype, TensorRole.LABELS, True)
        ctx = NodeContext(name, "MeanSquaredError", (output, labels), (None, None), (name,))
        op = mse_op(ctx, output, labels)
    b.tensors[labels.name] = labels
    b.tensors[name] = output_tensor(op, b.tensors)
    return op


def _refuse_shared_state(p: Prepared, ops: list[Op], tensors: dict[str, Tensor]) -> None:
    """A state tensor is updated by the one op that reads it: two readers would race."""
    readers: dict[str, list[str]] = {}
    for op in ops:
        for t in op.inputs:
            if tensors[t].role is TensorRole.STATE:
                readers.setdefault(t, []).append(op.name)
    for name, who in readers.items():
        if len(who) > 1:
            raise ModelError(
                f"{p.path}: state '{name}' is read {len(who)} times ({', '.join(who)}); "
                "running statistics belong to one op"
            )


def _share_weights(b: _Builder, ops: list[Op]) -> list[Op]:
    """A weight read more than once (tied embeddings, Add(W, W)) is read once, by an
    Identity op whose output every use reads instead. Each use may then be split its own
    way: the partitioner plans the moves between the Identity's tiles and the uses', and
    the uses' gradients are summed into the Identity's output gradient, then into the
    weight's, as for any activation read twice."""
    uses: dict[str, int] = {}
    for op in ops:
        for t in op.inputs:
            if b.tensors[t].role is TensorRole.WEIGHT:
                uses[t] = uses.get(t, 0) + 1
    shared = [w for w, n in uses.items() if n > 1]
    if not shared:
        return ops
    identity = registry().get("Identity")
    readers: dict[str, Op] = {}
    for w in shared:
        name = _fresh(b, f"{w}:shared")
        ctx = NodeContext(name, "Identity", (b.tensors[w],), (None,), (name,))
        op = identity.convert(ctx)
        b.tensors[name] = output_tensor(op, b.tensors)
        readers[w] = op
    renamed = {w: op.output for w, op in readers.items()}
    result: list[Op] = []
    for op in ops:
        result += [readers.pop(w) for w in op.inputs if w in readers]  # before its 1st use
        result.append(_reading(op, renamed))
    return result


def _fresh(b: _Builder, base: str) -> str:
    name = base
    while name in b.tensors or name in b.names:
        name += "_"
    b.names.add(name)
    return name


def _reading(op: Op, renamed: dict[str, str]) -> Op:
    """``op`` with its operands renamed (a shared weight read through its Identity)."""
    if not any(t in renamed for t in op.inputs):
        return op
    operands = tuple(replace(o, tensor=renamed.get(o.tensor, o.tensor)) for o in op.nest.inputs)
    return replace(
        op,
        inputs=tuple(renamed.get(t, t) for t in op.inputs),
        nest=replace(op.nest, inputs=operands),
    )


def build_graph(p: Prepared, loss: LossKind | None) -> Graph:
    found = _definitions(p)
    b = _Builder(p)
    for node, definition in zip(p.nodes, found, strict=True):
        if definition is None:  # an unfolded Shape, no node before it to blame
            raise ModelError(
                f"{p.path}: node '{node.name or node.output[0]}' (Shape): the shape of its "
                f"input '{node.input[0]}' is not static after shape inference, so it cannot "
                "be folded (a shape written in the file for another batch? export with a "
                "dynamic batch axis)"
            )
        b.convert(node, definition)
    own = [op for op in b.ops if op.is_loss]
    if len(p.graph_outputs) != 1 and not own:
        raise ModelError(
            f"{p.path}: expected one graph output, found {len(p.graph_outputs)}: "
            f"{list(p.graph_outputs)}"
        )
    if own:
        if loss not in (None, LossKind.MODEL):
            raise ModelError(
                f"{p.path}: the model computes its own loss (node '{own[0].name}'); it cannot "
                f"also get a {loss.value} loss attached"
            )
        loss_op = own[0]
        ops = _prune([op for op in b.ops if op is not loss_op], loss_op.inputs[0])
        ops.append(loss_op)
        kind, output, labels = LossKind.MODEL, loss_op.inputs[0], loss_op.inputs[1]
    else:
        kind = loss or LossKind.CROSS_ENTROPY
        output = b.aliases.get(p.graph_outputs[0], p.graph_outputs[0])
        ops = _prune(b.ops, output)
        labels = None
        if kind is not LossKind.NONE:
            if output not in b.tensors or b.tensors[output].role is not TensorRole.ACTIVATION:
                raise ModelError(f"{p.path}: graph output '{output}' is not computed by any op")
            loss_op = _attach_loss(b, b.tensors[output], kind)
            ops.append(loss_op)
            labels = loss_op.inputs[1]
    _refuse_shared_state(p, ops, b.tensors)
    ops = _share_weights(b, ops)
    # independent BatchNorms side by side: their statistics share a ring (issue 45)
    ops = side_by_side(ops)
    used = {t for op in ops for t in op.inputs} | {op.output for op in ops}
    inputs = tuple(n for n in p.graph_inputs if n in used and b.tensors[n].role is TensorRole.INPUT)
    if not inputs:
        raise ModelError(
            f"{p.path}: the model reads no data input (graph inputs: {list(p.graph_inputs)})"
        )
    return Graph(
        name=p.path.stem,
        tensors={k: v for k, v in b.tensors.items() if k in used},
        ops=tuple(ops),
        inputs=inputs,
        output=output,
        labels=labels,
        loss=kind,
        batch=p.batch,
    )
