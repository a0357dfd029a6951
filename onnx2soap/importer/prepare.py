"""Read an ONNX file and make its shapes static: bind the batch, fold constants, infer shapes.

The result is a ``Prepared`` model: the remaining (compute) nodes, a static shape and
element type for every tensor, the values of every constant, and where the bytes of
every float initializer (candidate weights) lie. Weights are never read here: their
bytes stay in the external data file, or are moved out of the parsed proto, so that
shape inference and folding handle a graph of shapes whatever the model's size.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from onnx2soap.errors import ModelError
from onnx2soap.importer.attention import fuse_attention
from onnx2soap.importer.gelu import fuse_tanh_gelu
from onnx2soap.importer.lazy import LazyValue, block_evaluator, lazy_elementwise, materialized
from onnx2soap.importer.rms_norm import fuse_rms_norm
from onnx2soap.importer.signature import untrained_initializers
from onnx2soap.importer.silu import fuse_silu
from onnx2soap.importer.transposed import fuse_transposed_operands
from onnx2soap.importer.weights import (
    FLOAT_TYPES,
    InlineData,
    StoredTensor,
    external_data,
)

MIN_OPSET = 13
_MAX_FOLD_PASSES = 16


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    elem_type: int  # onnx.TensorProto.DataType


@dataclass(frozen=True)
class Prepared:
    path: Path
    sha256: str
    opset: int
    opsets: dict[str, int]  # every imported domain's version ("ai.onnx" for the default)
    batch: int
    nodes: tuple[onnx.NodeProto, ...]
    types: dict[str, TensorType]
    constants: dict[str, np.ndarray]  # folded values and non-float initializers
    float_initializers: dict[str, StoredTensor]  # where their bytes are; never read here
    graph_inputs: tuple[str, ...]  # non-initializer inputs
    graph_outputs: tuple[str, ...]
    # Constants written in the file (initializers, Constant nodes), as opposed to those
    # folded from shapes at the bound batch: a literal shape was fixed at export time.
    literal: frozenset[str] = frozenset()
    # Initializers torch.export's signature calls buffers or constants: never trained.
    buffers: frozenset[str] = frozenset()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_model(path: Path) -> tuple[onnx.ModelProto, dict[str, StoredTensor]]:
    """Load and check an ONNX file without reading its weights: the model with every
    float initializer's payload moved out (dims and type kept), and where each one's
    bytes are. Refused with a ``ModelError`` naming the node, tensor or field: names that
    are not UTF-8, initializers whose data disagree with their dims, external data that
    is missing, short, or outside the model's folder, invalid models."""
    if not path.is_file():  # also refuses /dev/zero and FIFOs, which would never end
        raise ModelError(f"{path}: no such model file (or not a regular file)")
    # The checker reads the file itself (any size; external data is not read), before
    # Python holds the model: both at once would double a big inline model's memory.
    problem = _checker_problem(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises several unrelated types on garbage input
        raise ModelError(f"{path}: not a valid ONNX model ({type(e).__name__}: {e})") from e
    # Before anything prints or checks a name: invalid UTF-8 comes back as bytes.
    _check_strings(model, path)
    if not model.graph.node:
        raise ModelError(f"{path}: not a valid ONNX model (the graph has no nodes)")
    _check_constant_nodes(model, path)
    stored = _store_initializers(model, path)
    if problem is not None:  # our own checks above name the field more plainly
        raise ModelError(f"{path}: not a valid ONNX model ({problem})")
    return model, stored


def _checker_problem(path: Path) -> str | None:
    """The ONNX checker's first line about the file, or None when it passes."""
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else "validation failed"
    except Exception as e:  # the checker's parser fails on garbage; onnx.load names it
        return f"{type(e).__name__}: {_first_line(e)}"
    return None


def _is_repeated(field) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 5; older ones have a label
    return bool(flag) if flag is not None else field.label == field.LABEL_REPEATED


def _check_strings(message, path: Path, where: str = "model") -> None:
    """Every string field, nested messages included, must be valid UTF-8 (protobuf hands
    back bytes for one that is not; check_model and json.dumps would fail on it)."""
    for field, value in message.ListFields():
        values = value if _is_repeated(field) else [value]
        if field.type == field.TYPE_STRING:
            for i, v in enumerate(values):
                if isinstance(v, bytes):
                    at = f"{where}.{field.name}" + (f"[{i}]" if _is_repeated(field) else "")
                    raise ModelError(
                        f"{path}: {_owner(message, where)}{at} is not valid UTF-8 "
                        f"({v[:40]!r}); names must be UTF-8 text"
                    )
        elif field.type == field.TYPE_MESSAGE:
            for i, v in enumerate(values):
                suffix = f"[{i}]" if _is_repeated(field) else ""
                _check_strings(v, path, f"{where}.{field.name}{suffix}")


def _owner(message, where: str) -> str:
    """``node 'conv1' (Conv): `` when the message is a node with a readable name."""
    if isinstance(message, onnx.NodeProto):
        name = message.name if isinstance(message.name, str) and message.name else ""
        kind = message.op_type if isinstance(message.op_type, str) else "?"
        return f"node '{name}' ({kind}): " if name else f"a {kind} node: "
    return ""


_SUB_BYTE = {
    getattr(onnx.TensorProto, n)
    for n in ("INT4", "UINT4", "FLOAT4E2M1")
    if hasattr(onnx.TensorProto, n)
}


def _expected_raw_bytes(tensor: onnx.TensorProto, count: int) -> int | None:
    """Bytes ``raw_data`` must hold for ``count`` elements; None when not fixed-size."""
    if tensor.data_type in _SUB_BYTE:
        return (count + 1) // 2
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except Exception:  # an unknown data type: check_model names it
        return None
    return count * dtype.itemsize


def _check_size(tensor: onnx.TensorProto, label: str, path: Path) -> int | None:
    """The bytes the tensor's dims need (None when not fixed-size); a ModelError when its
    inline data disagree with its dims."""
    if any(d < 0 for d in tensor.dims):
        raise ModelError(f"{path}: {label}: dims {list(tensor.dims)} must be >= 0")
    count = int(np.prod(tensor.dims, dtype=object)) if tensor.dims else 1
    expected = _expected_raw_bytes(tensor, count)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return expected
    if tensor.HasField("raw_data"):
        if expected is not None and len(tensor.raw_data) != expected:
            raise ModelError(
                f"{path}: {label}: raw data holds {len(tensor.raw_data)} bytes, "
                f"but dims {list(tensor.dims)} need {expected}"
            )
    elif tensor.data_type != onnx.TensorProto.STRING:
        try:  # typed data (float_data, int64_data, ...): numpy's reshape checks the count
            numpy_helper.to_array(tensor)
        except Exception as e:  # typed data of the wrong length: numpy's reshape error
            raise ModelError(
                f"{path}: {label}: its data do not fit dims {list(tensor.dims)} ({e})"
            ) from e
    return expected


def _check_constant_nodes(model: onnx.ModelProto, path: Path) -> None:
    """Constant nodes' data fit their dims (they may hold -inf on purpose: masks)."""
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    label = f"node '{node.name or node.output[0]}' (Constant) value"
                    _check_size(attr.t, label, path)


def _is_weight_like(tensor: onnx.TensorProto) -> bool:
    """A float initializer with dims: a weight (or weight-like constant), never read at
    import. 0-d floats are the exporter's scalars; they fold like other constants."""
    return tensor.data_type in FLOAT_TYPES and len(tensor.dims) > 0


def _store_initializers(model: onnx.ModelProto, path: Path) -> dict[str, StoredTensor]:
    """Check every initializer's data against its dims, and say where each float one's
    bytes are. Weight-like ones keep dims and type only (their payload moved into the
    ``StoredTensor``, external ones not read); the small others are made inline, read
    from external data where they were (shapes and scalars fold at import)."""
    stored = {}
    for init in model.graph.initializer:
        label = f"initializer '{init.name}'"
        needed = _check_size(init, label, path)
        external = init.data_location == onnx.TensorProto.EXTERNAL
        where = external_data(init, path, label, needed) if external else None
        if init.data_type not in FLOAT_TYPES and not external:
            continue  # an integer constant, inline: folded as it is
        if init.data_type == onnx.TensorProto.STRING:
            raise ModelError(f"{path}: {label}: string tensors cannot be external data here")
        shape = tuple(int(d) for d in init.dims)
        if where is None:
            where = InlineData(_take_payload(init))
        tensor = StoredTensor(init.name, shape, init.data_type, where)
        if init.data_type in FLOAT_TYPES:
            stored[init.name] = tensor
        if not _is_weight_like(init):  # a scalar or an integer: its value, inline
            init.CopyFrom(numpy_helper.from_array(tensor.read(), init.name))
        else:
            _strip(init)
    return stored


def _take_payload(init: onnx.TensorProto) -> bytes:
    """The tensor's little-endian bytes, leaving the proto without them."""
    if init.HasField("raw_data"):
        payload = init.raw_data
    else:  # typed data: numpy's copy, then the field is cleared
        value = numpy_helper.to_array(init)
        payload = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
    _strip(init)
    return payload


def _strip(init: onnx.TensorProto) -> None:
    """Dims, type and name only: shape inference and folding never need a weight's values."""
    for name in (
        "raw_data",
        "float_data",
        "double_data",
        "int32_data",
        "int64_data",
        "uint64_data",
        "external_data",
    ):
        init.ClearField(name)
    init.data_location = onnx.TensorProto.DEFAULT


def default_opset(model: onnx.ModelProto, path: Path) -> int:
    """The ai.onnx opset: imported once, from MIN_OPSET up to the newest the installed
    onnx package defines (a newer one would be checked against rules it does not know)."""
    imports = [imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")]
    if not imports:
        raise ModelError(f"{path}: the model imports no ai.onnx opset")
    if len(imports) > 1:
        raise ModelError(
            f"{path}: opset_import: the ai.onnx opset is imported {len(imports)} times "
            f"(versions {imports}); a model imports it once"
        )
    version, newest = imports[0], onnx.defs.onnx_opset_version()
    if version < MIN_OPSET:
        raise ModelError(
            f"{path}: opset {version} is too old; onnx2soap reads opset "
            f"{MIN_OPSET} and newer (re-export with opset_version>={MIN_OPSET})"
        )
    if version > newest:
        raise ModelError(
            f"{path}: opset {version} is newer than the installed onnx {onnx.__version__} "
            f"knows (opsets {MIN_OPSET} to {newest})"
        )
    return version


def _bind_batch(model: onnx.ModelProto, path: Path, batch: int | None) -> int:
    """Set axis 0 of every graph input to the batch; refuse other symbolic dims."""
    init_names = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in init_names]
    static = []
    for inp in inputs:
        dims = inp.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            static.append(dims[0].dim_value)
    if batch is None:
        symbolic = [
            (i.name, i.type.tensor_type.shape.dim[0].dim_param or "?")
            for i in inputs
            if i.type.tensor_type.shape.dim
            and not i.type.tensor_type.shape.dim[0].HasField("dim_value")
        ]
        if symbolic:
            name, param = symbolic[0]
            raise ModelError(
                f"{path}: input '{name}' has a symbolic batch dimension '{param}'; pass --batch B"
            )
        if not static:
            raise ModelError(f"{path}: cannot tell the batch size; pass --batch B")
        batch = static[0]
    if batch < 1:
        raise ModelError(f"{path}: --batch must be at least 1, got {batch}")
    for inp in inputs:
        dims = inp.type.tensor_type.shape.dim
        if not dims:
            raise ModelError(f"{path}: input '{inp.name}' has no shape; a batched input is needed")
        dims[0].ClearField("dim_param")
        dims[0].dim_value = batch
        for axis, d in enumerate(dims[1:], start=1):
            if not d.HasField("dim_value"):
                raise ModelError(
                    f"{path}: input '{inp.name}' axis {axis} is symbolic ('{d.dim_param}'); "
                    f"only the batch (axis 0) may be symbolic"
                )
    # Stale annotations from the exporter would clash with the bound batch.
    del model.graph.value_info[:]
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    return batch


def _infer(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, data_prop=True)
    except Exception as e:  # inference errors come as several types
        raise ModelError(f"{path}: shape inference failed: {str(e).strip().splitlines()[0]}") from e


def _types(model: onnx.ModelProto) -> dict[str, TensorType]:
    types: dict[str, TensorType] = {}
    for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            types[vi.name] = TensorType(tuple(d.dim_value for d in tt.shape.dim), tt.elem_type)
    for init in model.graph.initializer:
        types[init.name] = TensorType(tuple(init.dims), init.data_type)
    return types


# Ops whose outputs are drawn at run time: folding them would freeze one draw (an
# EfficientNet's stochastic-depth mask) for the whole training.
RANDOM_OPS = frozenset(
    {
        "RandomUniform",
        "RandomUniformLike",
        "RandomNormal",
        "RandomNormalLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",  # in training mode, its mask too
    }
)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _evaluate_onnxruntime(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int):
    """One node run by onnxruntime: for large constants, and the fallback where onnx's
    reference evaluator fails on valid inputs (GatherElements in onnx 1.23)."""
    import onnxruntime

    inputs = [
        onnx.helper.make_tensor_value_info(
            n, onnx.helper.np_dtype_to_tensor_dtype(feeds[n].dtype), feeds[n].shape
        )
        for n in node.input
        if n
    ]
    graph = onnx.helper.make_graph([node], "fold", inputs, [])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v for v in inferred.graph.value_info}
    model.graph.output.extend(types[o] for o in node.output if o)
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return [np.asarray(v) for v in session.run(None, {n: feeds[n] for n in node.input if n})]


def _evaluate(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> list[np.ndarray]:
    # A large constant (a causal mask at the bound batch: 256 M elements for 64 sequences
    # of 2,048 tokens) runs in onnxruntime's kernels first, 10-20x faster than the
    # reference's Python ones (9 of a LLaMA shape's 13 s of import at batch 64); else
    # onnxruntime is the fallback where the reference fails on valid inputs. Either way
    # onnxruntime runs a node once, and the reference's error is the one reported.
    large = any(np.asarray(v).nbytes > LARGE_CONSTANT_BYTES for v in feeds.values())
    if large:
        with contextlib.suppress(Exception):
            return _evaluate_onnxruntime(node, feeds, opset)
    try:
        evaluator = ReferenceEvaluator(node, opsets={"": opset})
        return [np.asarray(v) for v in evaluator.run(None, feeds)]
    except Exception as reference_error:  # the reference evaluator raises what numpy raises
        if not large:
            with contextlib.suppress(Exception):
                return _evaluate_onnxruntime(node, feeds, opset)
        raise ModelError(
            f"node '{node.name or node.output[0]}' ({node.op_type}): its inputs are "
            f"constants, but evaluating it failed: {_first_line(reference_error)}"
        ) from reference_error


# Ops whose output is their inputs broadcast against each other, element by element
# (ONNX's multidirectional broadcasting, or one input's shape): evaluated on the inputs'
# distinct values only, their result broadcast back (``_evaluate_broadcast``).
ELEMENTWISE = frozenset(
    {
        *("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Where"),
        *("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor"),
        *("Not", "Neg", "Abs", "Cast", "Sign", "Exp", "Log", "Sqrt", "Reciprocal", "IsInf"),
        *("IsNaN", "Floor", "Ceil", "Identity"),
    }
)


COMPARED_BYTES = 64 << 20  # the most a value is compared along its axes for repeats


def compact(value, compare: bool = False) -> np.ndarray:
    """A value without its repeats, a view: size 1 along every axis it is broadcast over
    (a stride of 0) or, with ``compare`` and a value of at most ``COMPARED_BYTES``, whose
    slices all equal the first (position ids copied to every sequence of the batch)."""
    v = np.asarray(value)
    for axis, n in enumerate(v.shape):
        if n < 2:
            continue
        first = v[(slice(None),) * axis + (slice(0, 1),)]
        if v.strides[axis] == 0 or (
            compare
            and v.nbytes <= COMPARED_BYTES
            and np.array_equal(v, np.broadcast_to(first, v.shape))
        ):
            v = first
    return v


def _evaluate_broadcast(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int):
    """``_evaluate``, but a folded value repeated along axes (a causal mask expanded to
    the bound batch: [16, 1, 8192, 8192], 4 GiB in float32, of 8,192² distinct values) is
    held as a broadcast view of its distinct values, and an elementwise op on such
    values computes each distinct result once: folding a LLaMA at 8,192 tokens took
    23.7 GB before. Where even the distinct result is big, the op is not computed but
    kept as a ``LazyValue`` (``importer/lazy.py``: a mask at 32,768 tokens)."""
    if node.op_type == "Expand" and len(node.input) == 2:
        x, shape = feeds[node.input[0]], np.asarray(feeds[node.input[1]])
        target = np.broadcast_shapes(x.shape, tuple(int(n) for n in shape))
        if isinstance(x, LazyValue):
            return [x.expanded(target)]
        return [np.broadcast_to(compact(x, compare=True), target)]
    if node.op_type not in ELEMENTWISE or len(node.output) != 1:
        return _evaluate(node, {n: materialized(v) for n, v in feeds.items()}, opset)
    target = np.broadcast_shapes(*(v.shape for v in feeds.values()))
    distinct = {
        n: v if isinstance(v, LazyValue) else compact(v, compare=True) for n, v in feeds.items()
    }
    lazy = lazy_elementwise(node, distinct, target, _block_evaluator(node, opset))
    if lazy is not None:
        return [lazy]
    (out,) = _evaluate(node, distinct, opset)
    out = np.asarray(out)
    return [out if out.shape == target else np.broadcast_to(out, target)]


def _block_evaluator(node: onnx.NodeProto, opset: int):
    """Runs ``node`` on the blocks of a lazy value: one reference evaluator for all of
    them (onnxruntime makes a session per call, which costs more than a block), and
    ``_evaluate`` where it fails."""
    evaluator = ReferenceEvaluator(node, opsets={"": opset})

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return [np.asarray(v) for v in evaluator.run(None, feeds)]
        except Exception:  # the reference fails on some valid inputs (see _evaluate)
            return _evaluate(node, feeds, opset)

    return block_evaluator(node, run)


def _split_sequences(
    model: onnx.ModelProto, types: dict[str, TensorType], large: dict[str, np.ndarray]
) -> tuple[onnx.ModelProto, bool]:
    """``SequenceAt(SplitToSequence(x, split, axis), k)`` with constant splits and
    positions (what dynamo writes for ``torch.split`` without its optimizer) becomes one
    ``Split`` whose outputs are the picked parts: the same tensors, no sequences."""
    nodes = list(model.graph.node)
    known = {
        i.name: numpy_helper.to_array(i)
        for i in model.graph.initializer
        # a weight's payload and a large folded value are not here: never a split's size
        if not _is_weight_like(i) and i.name not in large
    }
    known.update(
        (n.output[0], numpy_helper.to_array(n.attribute[0].t))
        for n in nodes
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    )
    splits = {n.output[0]: n for n in nodes if n.op_type == "SplitToSequence"}
    picks = [n for n in nodes if n.op_type == "SequenceAt" and n.input[0] in splits]
    if not picks:
        return model, False
    replaced: dict[int, onnx.NodeProto] = {}
    done = set()
    for seq, split in splits.items():
        mine = [p for p in picks if p.input[0] == seq]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in split.attribute}
        sizes = known.get(split.input[1]) if len(split.input) > 1 else None
        axis = int(attrs.get("axis", 0))
        source = types.get(split.input[0])
        if sizes is not None and np.ndim(sizes) == 0 and source is not None:
            # a scalar split: chunks of that size, the last one shorter
            total, step = source.shape[axis], int(sizes)
            sizes = [min(step, total - lo) for lo in range(0, total, step)] if step > 0 else None
        positions = [known.get(p.input[1]) for p in mine]
        if (
            not mine
            or sizes is None
            or np.ndim(sizes) != 1
            or attrs.get("keepdims", 1) != 1
            or any(v is None for v in positions)
            or len({int(v) % len(sizes) for v in positions}) != len(positions)  # repeats
            or len([p for p in picks if p.input[0] == seq]) != len(mine)
            or any(seq in n.input for n in nodes if n.op_type != "SequenceAt")
        ):
            continue
        count = len(sizes)
        outputs = [f"{seq}:part{k}" for k in range(count)]
        for p, v in zip(mine, positions, strict=True):
            outputs[int(v) % count] = p.output[0]
        sizes_name = f"{seq}:sizes"
        model.graph.initializer.append(
            numpy_helper.from_array(np.asarray(sizes, dtype=np.int64), sizes_name)
        )
        replaced[id(split)] = onnx.helper.make_node(
            "Split", [split.input[0], sizes_name], outputs, name=split.name or seq, axis=axis
        )
        done.add(id(split))
        done.update(id(p) for p in mine)
    if not done:
        return model, False
    kept = []
    for n in nodes:
        if id(n) in done:
            if n.op_type == "SplitToSequence":
                kept.append(replaced[id(n)])
            continue
        kept.append(n)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model, True


def _fold_pass(
    model: onnx.ModelProto,
    opset: int,
    float_inits: set[str],
    literal: set[str],
    large: dict[str, np.ndarray],
) -> tuple[onnx.ModelProto, bool]:
    """Fold Shape nodes and nodes whose inputs are all non-weight constants. Folded
    values past ``LARGE_CONSTANT_BYTES`` (a causal mask) go into ``large`` and the model
    keeps their dims only, so that shape inference never serializes them."""
    types = _types(model)
    # 0-d float initializers are constants (see the importer's roles), so they fold too.
    known = {
        i.name: numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.name not in large and (i.name not in float_inits or not i.dims)
    }
    known.update(large)
    kept, changed = [], False
    for node in model.graph.node:
        if node.op_type == "Shape" and node.input[0] in types:
            # Python slicing clamps and wraps start/end exactly as the ONNX spec does.
            attrs = {a.name: a.i for a in node.attribute}
            window = slice(attrs.get("start", 0), attrs.get("end"))
            outs = [np.array(types[node.input[0]].shape[window], dtype=np.int64)]
        elif node.op_type == "CastLike" and node.input[0] in known and node.input[1] in types:
            # Only the second input's element type matters: a constant cast to it.
            target = onnx.helper.tensor_dtype_to_np_dtype(types[node.input[1]].elem_type)
            outs = [np.asarray(known[node.input[0]]).astype(target)]
        elif (
            node.domain in ("", "ai.onnx")
            and node.op_type not in RANDOM_OPS
            and all(not n or n in known for n in node.input)
        ):
            outs = _evaluate_broadcast(node, {n: known[n] for n in node.input if n}, opset)
        else:
            kept.append(node)
            continue
        changed = True
        known.update(zip(node.output, outs, strict=False))
        # Computed from literals alone, a value is literal too; anything through a Shape
        # depends on the bound batch.
        if node.op_type != "Shape" and all(not n or n in literal for n in node.input):
            literal.update(node.output)
    if not changed:
        return model, False
    needed = {n for node in kept for n in node.input} | {o.name for o in model.graph.output}
    graph = model.graph
    inits = [i for i in graph.initializer if i.name in needed]
    present = {i.name for i in inits}
    for name, v in known.items():
        if name in needed and name not in present:
            value = v if isinstance(v, LazyValue) else np.asarray(v)
            inits.append(_folded_initializer(name, value, large))
    new_graph = onnx.helper.make_graph(
        kept, graph.name, list(graph.input), list(graph.output), inits
    )
    folded = onnx.helper.make_model(new_graph, opset_imports=list(model.opset_import))
    folded.ir_version = model.ir_version
    return folded, True


LARGE_CONSTANT_BYTES = 64 << 10  # shape tensors and scalars are far smaller


def _folded_initializer(name: str, value: np.ndarray | LazyValue, large: dict) -> onnx.TensorProto:
    """A folded value as an initializer: whole when small (data propagation may read a
    shape), else its dims only, the value kept in ``large`` (a lazy one always: it is
    not computed)."""
    if not isinstance(value, LazyValue) and value.nbytes <= LARGE_CONSTANT_BYTES:
        # asarray, not ascontiguousarray: that one makes a 0-d scalar 1-d.
        return numpy_helper.from_array(np.asarray(value, order="C"), name)
    large[name] = value
    elem = onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
    return onnx.TensorProto(name=name, data_type=elem, dims=value.shape)


def _computed(
    values: dict[str, np.ndarray | LazyValue],
    nodes: list[onnx.NodeProto],
    graph_outputs: tuple[str, ...],
) -> dict[str, np.ndarray]:
    """The constants with every lazy value that a node or the graph still reads computed,
    and those nothing reads (a causal mask the fusion consumed) left out."""
    read = {n for node in nodes for n in node.input} | set(graph_outputs)
    return {
        k: materialized(v) for k, v in values.items() if not isinstance(v, LazyValue) or k in read
    }


def prepare(path: Path, batch: int | None) -> Prepared:
    model, stored = read_model(path)
    buffers = untrained_initializers(model)  # before folding rebuilds the graph without it
    opset = default_opset(model, path)
    batch = _bind_batch(model, path, batch)
    # Float initializers are weights (or weight-like constants): never folded away.
    float_inits = set(stored)
    model = _infer(model, path)
    literal = {i.name for i in model.graph.initializer}
    large: dict[str, np.ndarray] = {}  # folded values too big to go through the proto
    for _ in range(_MAX_FOLD_PASSES):
        try:
            model, changed = _fold_pass(model, opset, float_inits, literal, large)
            # The splits' sizes may need shapes folding has just made static.
            model, rewritten = _split_sequences(model, _types(model), large)
            changed = changed or rewritten
        except ModelError as e:
            raise ModelError(f"{path}: {e}") from e
        if not changed:
            break
        model = _infer(model, path)
    init_names = {i.name for i in model.graph.initializer}
    values = {
        i.name: large[i.name] if i.name in large else numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.name not in float_inits
    }
    types = _types(model)
    graph_outputs = tuple(o.name for o in model.graph.output)
    # the exporters' float scalars (a score scale) are float initializers kept for the
    # ops that read them; the fusion reads their values
    scalars = {
        i.name: numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.name in float_inits and not i.dims
    }

    def constant(name: str) -> np.ndarray | None:
        return values[name] if name in values else scalars.get(name)

    fused = fuse_attention(
        model.graph.node,
        constant,
        {k: (t.shape, t.elem_type) for k, t in types.items()},
        graph_outputs,
    )
    nodes = fuse_transposed_operands(
        fused.nodes, {k: len(t.shape) for k, t in types.items()}, graph_outputs
    )
    nodes = fuse_tanh_gelu(nodes, constant, graph_outputs)
    nodes = fuse_rms_norm(nodes, constant, types, graph_outputs)
    nodes = fuse_silu(nodes, constant, graph_outputs)
    return Prepared(
        path=path,
        sha256=file_sha256(path),
        opset=opset,
        opsets={imp.domain or "ai.onnx": imp.version for imp in model.opset_import},
        batch=batch,
        nodes=tuple(nodes),
        types={**types, **{k: TensorType(*t) for k, t in fused.types.items()}},
        constants=_computed(values, nodes, graph_outputs),
        float_initializers={k: v for k, v in stored.items() if k in init_names},
        graph_inputs=tuple(i.name for i in model.graph.input if i.name not in init_names),
        graph_outputs=graph_outputs,
        literal=frozenset(literal),
        buffers=buffers,
    )
