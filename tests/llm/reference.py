"""Torch's side of the comparisons: a family's torch module holding exactly the file's
initializers and float32 numbers, one batch of data, and one ``torch.optim.SGD`` step.

The export is float64 (``zoo.export_family``), so every initializer and nearly every
constant is float64. What the file holds in float32, torch is made to use as the file says
it: the epsilons of LayerNormalization and InstanceNormalization (float attributes, float32
by the ONNX spec: torch's 1e-5 is 9.999999747e-06 there) and of the RMSNorms, which the
dynamo exporter stores as a FLOAT constant (1e-6 is 9.99999997e-07). T5's relative
position buckets take logarithms in float32 in torch too (``.float()``); they fold to
integer constants at import. Any other float32 number in a file fails the test that reads
it, naming it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from onnx2soap.importer.signature import untrained_initializers
from tests.llm.zoo import CLASSES, FAMILIES, PAD, VOCABULARY

IGNORE = -100  # torch's CrossEntropyLoss ignore_index, which the importer's loss keeps
# The float32 numbers a file may hold besides the epsilons: exact in float32, or T5's
# bucket logarithms log(8) and log(4) (relative_attention_max_distance 16, 8 buckets),
# folded away at import.
EXACT = {0.0, 0.5, 1.0, -1.0, 2.0, -math.inf, math.inf}
T5_BUCKET_LOGS = {float(np.float32(math.log(8))), float(np.float32(math.log(4)))}


def f32(value: float) -> float:
    return float(np.float32(value))


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread: the machine is small and mpiexec's ranks run beside it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _float32_numbers(proto) -> set[float]:
    """Every float32 number of the graph: FLOAT constants and float attributes."""
    import onnx
    from onnx import numpy_helper

    numbers: set[float] = set()
    for init in proto.graph.initializer:
        assert init.data_type != onnx.TensorProto.FLOAT, f"{init.name} is float32"
    for node in proto.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.FLOAT:
                numbers.add(float(a.f))
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == onnx.TensorProto.FLOAT:
                numbers.update(float(v) for v in numpy_helper.to_array(a.t).ravel())
    return numbers


def _epsilons(model) -> dict[object, str]:
    """Every normalization module of ``model`` -> the attribute holding its epsilon."""
    import torch

    found: dict[object, str] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm | torch.nn.GroupNorm):
            found[m] = "eps"
        elif hasattr(m, "variance_epsilon"):  # HF's RMSNorms (Llama, Mistral, Qwen2, T5)
            found[m] = "variance_epsilon"
    return found


def _make_like_the_file(name: str, model, proto) -> None:
    """Give the model's epsilons the file's float32 values, after checking that the file
    holds no float32 number torch is not told about."""
    norms = _epsilons(model)
    rounded = {f32(getattr(m, attr)) for m, attr in norms.items()}
    allowed = EXACT | rounded | (T5_BUCKET_LOGS if name == "t5" else set())
    unexpected = sorted(_float32_numbers(proto) - allowed)
    assert not unexpected, f"{name}: float32 numbers torch is not told about: {unexpected}"
    for m, attr in norms.items():
        setattr(m, attr, f32(getattr(m, attr)))


def torch_model(name: str, path: Path):
    """Family ``name`` in float64 and train mode, holding exactly the file's initializers.
    Returns (model, {torch parameter name: initializer name}), every trainable parameter
    (a tied one under its first name) in the map once."""
    import onnx
    import torch
    from onnx import numpy_helper

    proto = onnx.load(path)  # the dynamo export's external data beside it, too
    initializers = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    model = FAMILIES[name].build(seed=0).double().train()
    _make_like_the_file(name, model, proto)
    aliases: dict[int, list[str]] = {}  # one parameter -> all its names (tied weights)
    for pname, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(pname)
    onnx_name: dict[str, str] = {}
    for names in aliases.values():
        found = [n for n in names if n in initializers]
        assert len(found) == 1, f"{name}: parameter {names} as initializers {found}"
        onnx_name[names[0]] = found[0]
    # Float initializers that are no parameter are buffers (rotary frequencies, BART's
    # final logits bias), which the exporter's signature names and the importer does not
    # train; torch holds them too.
    buffers = dict(model.named_buffers())
    fixed = untrained_initializers(proto)
    floats = {n for n, v in initializers.items() if v.dtype.kind == "f"}
    assert floats - fixed == set(onnx_name.values()), (name, sorted(floats - fixed))
    assert floats & fixed <= set(buffers), (name, sorted(floats & fixed))
    with torch.no_grad():
        for names in aliases.values():
            p = model.get_parameter(names[0])
            value = torch.from_numpy(initializers[onnx_name[names[0]]])
            assert p.shape == value.shape, names
            p.copy_(value)
        for n in floats & fixed:
            buffers[n].copy_(torch.from_numpy(initializers[n]))
    return model, onnx_name


def batch_data(name: str, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One batch: an array per ONNX input and ``labels``.

    Token labels have ignored (-100) positions. RoBERTa's padded positions (mask 0) hold
    the padding id, which its embeddings never train (``padding_idx``; ONNX cannot say so,
    and a Gather's gradient reaches every row it reads): there its labels are ignored too,
    so that nothing the loss reads depends on them (masked keys get attention weight
    exactly 0) and the padding rows' gradients are exactly zero on both sides. T5 and BART
    read their labels as ids too (shifted right into the decoder's inputs): those are valid
    ids, the ignored positions marked in ``labels`` only."""
    family = FAMILIES[name]
    arrays: dict[str, np.ndarray] = {}
    for spec in family.inputs:
        shape = (batch, *spec.shape)
        if spec.kind == "ids":
            arrays[spec.name] = rng.integers(spec.low, VOCABULARY, shape, dtype=np.int64)
        elif spec.kind == "mask":
            mask = np.ones(shape, dtype=np.int64)
            mask[1, -3:] = 0
            mask[-1, -1:] = 0
            arrays[spec.name] = mask
        else:
            arrays[spec.name] = rng.standard_normal(shape)
    if not family.tokens:
        arrays["labels"] = rng.integers(0, CLASSES, batch, dtype=np.int64)
        return arrays
    tokens = family.inputs[-1].shape[0]
    labels = arrays.get("target_ids", rng.integers(0, VOCABULARY, (batch, tokens)))
    labels = labels.copy()
    labels[0, :2] = IGNORE
    labels[-1, 3] = IGNORE
    if "attention_mask" in arrays:
        padded = arrays["attention_mask"] == 0
        arrays["input_ids"][padded] = PAD
        labels[padded] = IGNORE
    arrays["labels"] = labels
    return arrays


@contextmanager
def float64_throughout() -> Iterator[None]:
    """Torch computing in float64 where a model asks for float32: HF's RMSNorms, rotary
    embeddings and attention softmax compute in float32 on purpose, even in a float64
    model (``.float()``, ``.to(torch.float32)``, ``softmax(..., dtype=torch.float32)``),
    and the exporter writes those as Casts to FLOAT. The executor runs every float in the
    run's dtype (a Cast between float types is the identity there), so in float64 the
    reference must not round to float32 either: every float32 dtype asked of any torch
    function becomes float64."""
    import torch
    from torch.overrides import TorchFunctionMode

    def widened(value):
        return torch.float64 if value is torch.float32 else value

    class Float64(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.float:
                return args[0].to(torch.float64)
            args = tuple(widened(a) for a in args)
            kwargs = {k: widened(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    with Float64():
        yield


def torch_step(name: str, model, arrays: dict[str, np.ndarray], lr: float):
    """One SGD step of torch's CrossEntropyLoss over the last axis (label -100 ignored,
    the mean over the others: what the importer attaches). Returns (loss, {torch
    parameter name: its value after the step})."""
    import torch

    args = [torch.from_numpy(arrays[spec.name]) for spec in FAMILIES[name].inputs]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.zero_grad()
    with float64_throughout():
        logits = model(*args)
    assert logits.dtype == torch.float64
    labels = torch.from_numpy(arrays["labels"])
    loss = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    )
    loss.backward()
    optimizer.step()
    return loss.item(), {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
