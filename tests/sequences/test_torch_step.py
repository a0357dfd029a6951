"""One float64 SGD step of the executor is one ``torch.optim.SGD`` step of the same
sequence model (``tests/sequence_models.py``, dropout 0), on 1 rank and on a random
3-rank plan (three drawn cases a run: tests/sampling.py): every model of
tests/sequence_models.py. GPT-2 (LM head tied to the token embedding), BERT (attention
mask with padded tokens), ViT, T5 and BART (encoder-decoder, token logits), torch's
TransformerEncoder, an LSTM language model, a GRU classifier and a LayerNorm-GELU MLP.
ViT and T5 round to float32 inside the float64 graph (torch and the file alike), so they
are held to what that rounding allows (ROUNDING_TOLERANCES: their loss within 1e-10 and
2e-9, their weights within 1e-10 and 5e-9 absolute); BART's final_logits_bias, a torch
buffer, is trained as the file's initializer it is.

Compared: the loss (torch's CrossEntropyLoss over the last axis, label -100 ignored, the
mean over kept positions: what the importer attaches) to 1e-12 relative, and every
trainable weight after the step to 1e-10 relative with an absolute floor of 1e-12. The
floor is for the attention key biases: softmax is unchanged by adding one number to every
score of a query, and ``q . b_k`` is such a number, so their gradient is zero in exact
arithmetic; they start at zero and both sides hold rounding noise (1e-24 to 2e-19) after
the step, which no two summation orders agree on. Everything else agrees to 2e-13 or
better except TransformerEncoder's packed q/k/v bias (1.2e-11, in its small entries).

The model is exported in float64 (``.double()``, float examples in float64), so every
initializer and nearly every constant in the file is float64 and torch's Python floats
(attention scales, GELU's sqrt(2)) reach the file exactly. What stays float32, and which
torch is therefore made to use, as the file says it:

* ``LayerNormalization``'s epsilon, a float attribute (float32 by the ONNX spec): 1e-5
  is 9.999999747e-06 in the file, BERT's 1e-12 is 9.99999996e-13;
* in the dynamo export of GPT-2 (its legacy export fails in torch, ``aten::diff``), the
  Python scalars of the traced graph: torchlib's ``scalar_tensor`` stores each as a
  FLOAT constant and Casts it to double, so the attention scale 8**-0.5 and gelu_new's
  sqrt(2/pi) and 0.044715 are float32-rounded (relative 1.7e-8, 2.8e-8 and 3.5e-8 off).
  Every other float32 constant or float attribute must be exact in float32 (0, 0.5, 1,
  -inf), or the test says which one is not.

With torch's own values instead, GPT-2's weights part by up to 7e-7 (its loss by 7e-13),
TransformerEncoder's by 6e-10 and the MLP's by 1e-10.

The torch model starts from the file's initializers, by name: the legacy exporter and
the dynamo exporter with ``optimize=False`` keep the parameter names, and GPT-2's tied
weight is ONE initializer (named ``model.lm_head.weight``), which is torch's
``lm_head.weight`` and ``transformer.wte.weight`` alike.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tests.executor.mpi import make_plan, mpirun
from tests.optional import require
from tests.sampling import seeded_sample

pytestmark = pytest.mark.mpi

BATCH, LR = 6, 0.1
LOSS_RTOL, RTOL, ATOL = 1e-12, 1e-10, 1e-12
RANDOM_RANKS, RANDOM_SEED = 3, 7
EXPORT_BATCH = 2
# model -> exporter: GPT-2's legacy export fails in torch (aten::diff); dynamo keeps the
# tie as one initializer only with optimize=False (tests.sequence_models' dynamo export).
EXPORTERS = {
    "gpt2": "dynamo",
    "bert": "legacy",
    "vit": "legacy",
    "t5": "legacy",
    "bart": "legacy",
    "transformer_encoder": "legacy",
    "lstm_lm": "legacy",
    "gru_classifier": "legacy",
    "mlp_ln_gelu": "legacy",
}
# case -> (model, bound of the token ids drawn; None: the vocabulary).
CASES = {name: (name, None) for name in EXPORTERS}
# GPT-2 reads its ids through a Reshape (transformers' input_ids.view(-1, T)): the
# executor must follow it to the embedding to know the ids' bound (a regression test for
# executor.data.id_bound). Ids 0 and 1 alone give the tied weight the embedding gradient
# in two rows and the LM head's in all 64: a second, sparser check.
CASES["gpt2_ids_0_1"] = ("gpt2", 2)
# logits [N, T, V], labels [N, T]; the others [N, C]
TOKEN_LABELS = {"gpt2", "lstm_lm", "t5", "bart"}
# Models that round to float32 inside the float64 graph, in torch as in the file: ViT's
# attention probabilities (see _attention_as_the_file), T5's layer-norm variance and
# relative-position buckets. A value within 1e-16 of a float32 rounding boundary rounds
# one way here and the other way in torch, 6e-8 apart: (loss rtol, weight rtol, atol).
ROUNDING_TOLERANCES = {"vit": (1e-10, 1e-8, 1e-10), "t5": (2e-9, 1e-8, 5e-9)}
# BERT's word embedding has padding_idx 0 (pad_token_id): torch never updates that row,
# and ONNX cannot say so (a Gather's gradient reaches every row it read). So the pad id
# is in the data only where the attention mask is 0, as a tokenizer pads: there its
# gradient is zero in exact arithmetic too (masked keys and values get softmax weight
# exactly 0; the classifier reads position 0 only). Anywhere else, the executor moves
# the row (by ~2e-6 in the first try of this test) and torch does not.
PAD_ID = {"bert": 0}
# BART's embeddings have padding_idx 1 (pad_token_id) too; its ids start at 3
# (tests.sequence_models), so no token is the pad and the row takes no gradient.
EMBEDDING_PAD = {**{name: {pad} for name, pad in PAD_ID.items()}, "bart": {1}}
# Values a float32 constant or attribute may hold: the same number in float64.
EXACT_IN_FLOAT32 = {0.0, 0.5, 1.0, -math.inf}


def f32(value: float) -> float:
    return float(np.float32(value))


# GPT-2 (dynamo): the float32-rounded scalars torch is given, each as the file holds it.
HEAD_DIM = 8  # tests.sequence_models: WIDTH 16 / HEADS 2
GELU_ROOT, GELU_CUBIC = f32(math.sqrt(2.0 / math.pi)), f32(0.044715)
ROUNDED = {"gpt2": {f32(HEAD_DIM**-0.5), GELU_ROOT, GELU_CUBIC}}
# T5 computes in float32 inside the float64 model, in torch as in the file: its layer
# norm's variance (epsilon 1e-6) and its relative-position buckets (log(4), log(8) and
# the bucket counts 2 and 4 in float32). The file's numbers are torch's.
FLOAT32_MATH = {"t5": {f32(1e-6), f32(math.log(4)), f32(math.log(8)), 2.0, 4.0}}

Export = Callable[[str], Path]


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch on one thread: the machine is small and mpiexec's ranks run beside it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _export_float64(name: str, directory: Path) -> Path:
    """``export_sequence`` of a float64 model: the builder's model ``.double()``, float
    example inputs in float64 (ids stay int64), the same two export paths."""
    import torch

    from tests.sequence_models import SEQUENCE_MODELS, export_built, sequence_inputs

    model = SEQUENCE_MODELS[name].build(seed=0, dropout=0.0).double()
    args = tuple(
        a.to(torch.float64) if a.is_floating_point() else a
        for a in sequence_inputs(name, EXPORT_BATCH)
    )
    path = directory / f"{name}_{EXPORTERS[name]}_float64.onnx"
    return export_built(name, model, args, path, EXPORTERS[name])


@pytest.fixture(scope="module")
def float64_sequence_onnx(tmp_path_factory: pytest.TempPathFactory) -> Export:
    """``get(name)`` -> the float64 export of model ``name``, exported once per module."""
    require("torch")
    require("onnx")
    directory = tmp_path_factory.mktemp("sequence_torch_step")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            if name in ("gpt2", "bert"):
                require("transformers")
            with warnings.catch_warnings(), _one_torch_thread():
                warnings.simplefilter("ignore")  # the exporters' notes on training mode
                cache[name] = _export_float64(name, directory)
        return cache[name]

    return get


# --- what the file says --------------------------------------------------------------


def _float32_numbers(proto) -> tuple[set[float], set[float]]:
    """(LayerNormalization epsilons, every other float32 number of the graph: FLOAT
    constants and float attributes). Asserts every initializer is float64."""
    import onnx
    from onnx import numpy_helper

    for init in proto.graph.initializer:
        assert init.data_type == onnx.TensorProto.DOUBLE, f"{init.name} is not float64"
    epsilons: set[float] = set()
    numbers: set[float] = set()
    for node in proto.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.FLOAT:
                if node.op_type == "LayerNormalization" and a.name == "epsilon":
                    epsilons.add(float(a.f))
                else:
                    numbers.add(float(a.f))
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in (
                onnx.TensorProto.FLOAT,
                onnx.TensorProto.FLOAT16,
                onnx.TensorProto.BFLOAT16,
            ):
                numbers.update(float(v) for v in numpy_helper.to_array(a.t).ravel())
    return epsilons, numbers


def _make_like_the_file(name: str, model, proto) -> None:
    """Give ``model`` the file's float32 numbers (see the module docstring), after
    checking that they are all the file has."""
    import torch

    epsilons, numbers = _float32_numbers(proto)
    rounded = ROUNDED.get(name, set())
    unexpected = sorted(numbers - EXACT_IN_FLOAT32 - rounded - FLOAT32_MATH.get(name, set()))
    assert not unexpected, f"{name}: float32 numbers torch is not told about: {unexpected}"
    assert rounded <= numbers, f"{name}: the file no longer holds {sorted(rounded - numbers)}"

    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert epsilons == {f32(m.eps) for m in norms}, (name, epsilons)
    for m in norms:
        m.eps = f32(m.eps)

    if name == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention

        class FileNewGelu(torch.nn.Module):
            """transformers' gelu_new with the file's float32 sqrt(2/pi) and 0.044715."""

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                inner = GELU_ROOT * (x + GELU_CUBIC * torch.pow(x, 3.0))
                return 0.5 * x * (1.0 + torch.tanh(inner))

        attentions = [m for m in model.modules() if isinstance(m, GPT2Attention)]
        mlps = [m for m in model.modules() if isinstance(m, GPT2MLP)]
        assert attentions and mlps
        for m in attentions:
            assert m.head_dim == HEAD_DIM and m.scaling == HEAD_DIM**-0.5
            m.scaling = f32(m.scaling)
        for m in mlps:
            m.act = FileNewGelu()


def _torch_model(name: str, path: Path):
    """The builder's model in float64 and train mode, holding exactly the file's
    initializers. Returns (model, {torch parameter name: ONNX initializer name}), every
    trainable parameter (a tied one under each of its names) in the map once."""
    import onnx
    import torch
    from onnx import numpy_helper

    from tests.sequence_models import SEQUENCE_MODELS

    proto = onnx.load(path)  # the dynamo export's external data beside it, too
    initializers = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    model = SEQUENCE_MODELS[name].build(seed=0, dropout=0.0).double().train()
    if name == "bart":
        # BART's final_logits_bias is a buffer in torch, an initializer in the file, and
        # the executor trains every float initializer (ONNX cannot say "frozen"): torch
        # trains it too, so that both step the model the file describes.
        hf = model.model
        bias = hf._buffers.pop("final_logits_bias")
        hf.final_logits_bias = torch.nn.Parameter(bias)
    _make_like_the_file(name, model, proto)
    padded = {
        m.padding_idx
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None
    }
    assert padded == EMBEDDING_PAD.get(name, set()), (name, padded)

    aliases: dict[int, list[str]] = {}  # one parameter -> all its names
    for pname, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(pname)
    onnx_name: dict[str, str] = {}  # torch's canonical (first) name -> initializer
    for names in aliases.values():
        found = [n for n in names if n in initializers]
        assert len(found) == 1, f"{name}: parameter {names} as initializers {found}"
        onnx_name[names[0]] = found[0]
    if name == "gpt2":
        tied = {"model.transformer.wte.weight", "model.lm_head.weight"}
        assert any(set(names) == tied for names in aliases.values()), "GPT-2 is not tied"
        assert len(initializers) == len(aliases), "a tied weight stored twice"
    unused = set(initializers) - set(onnx_name.values())
    assert not unused, f"{name}: initializers no parameter holds: {sorted(unused)}"
    with torch.no_grad():
        for names in aliases.values():
            value = torch.from_numpy(initializers[onnx_name[names[0]]])
            p = model.get_parameter(names[0])
            assert p.shape == value.shape, names
            p.copy_(value)
    return model, onnx_name


def _data(name: str, rng: np.random.Generator, ids_high: int | None) -> dict[str, np.ndarray]:
    """One batch: an array per ONNX input and ``labels`` (ids below ``ids_high`` if set)."""
    from tests.sequence_models import CLASSES, SEQUENCE_MODELS, TOKENS, VOCABULARY

    arrays: dict[str, np.ndarray] = {}
    pad = PAD_ID.get(name)
    for spec in SEQUENCE_MODELS[name].inputs:
        shape = (BATCH, *spec.shape)
        if spec.kind == "ids":
            low = spec.low if pad is None else max(spec.low, pad + 1)
            assert pad is None or pad < low
            high = spec.high if ids_high is None else ids_high
            arrays[spec.name] = rng.integers(low, high, shape, dtype=np.int64)
        elif spec.kind == "mask":
            mask = np.ones(shape, dtype=np.int64)
            mask[1, -3:] = 0  # padded sequences
            mask[4, -1:] = 0
            arrays[spec.name] = mask
        else:
            arrays[spec.name] = rng.standard_normal(shape)
    if pad is not None:
        arrays["input_ids"][arrays["attention_mask"] == 0] = pad
    if name in TOKEN_LABELS:
        labels = rng.integers(0, VOCABULARY, (BATCH, TOKENS), dtype=np.int64)
        labels[0, :3] = -100  # ignored positions
        labels[3, 5] = -100
        labels[5, -2:] = -100
    else:
        labels = rng.integers(0, CLASSES, BATCH, dtype=np.int64)
    arrays["labels"] = labels
    return arrays


@contextmanager
def _attention_as_the_file(name: str) -> Iterator[None]:
    """ViT's eager attention takes its softmax in float32 (``softmax(..., dtype=float32)``,
    then back to float64); the file says Softmax in float64, then Cast to float32 and
    back. So torch computes it as the file does while the step runs (the same rounding
    of the probabilities to float32; computed in float32, they part at 1e-9)."""
    if name != "vit":
        yield
        return
    import torch
    from transformers.models.vit import modeling_vit

    eager = modeling_vit.eager_attention_forward

    def as_the_file(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.nn.functional.softmax(weights, dim=-1).to(torch.float32).to(query.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    modeling_vit.eager_attention_forward = as_the_file
    try:
        yield
    finally:
        modeling_vit.eager_attention_forward = eager


def _torch_step(name: str, model, arrays: dict[str, np.ndarray]):
    """One SGD step; returns (loss, {torch name: tensor after the step})."""
    import torch

    from tests.sequence_models import SEQUENCE_MODELS

    args = [torch.from_numpy(arrays[spec.name]) for spec in SEQUENCE_MODELS[name].inputs]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.zero_grad()
    with _attention_as_the_file(name):
        logits = model(*args)
    loss = torch.nn.CrossEntropyLoss()(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(arrays["labels"]).reshape(-1)
    )
    loss.backward()
    optimizer.step()
    return loss.item(), {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


# Every case against torch on one device; on the random 3-rank plan, a drawn few a run
# (tests/sampling.py: CI's 20 minutes). tests/sequences/test_sequences.py trains every
# model on a random plan like one device, every run.
STEPPED = [pytest.param(1, "data-parallel", case) for case in sorted(CASES)] + seeded_sample(
    [(RANDOM_RANKS, "random", case) for case in sorted(CASES)], "sequences-torch-step", 3
)


@pytest.mark.parametrize(("ranks", "strategy", "case"), STEPPED)
def test_one_step_is_torch_sgd(
    float64_sequence_onnx: Export, tmp_path: Path, case: str, ranks: int, strategy: str
) -> None:
    name, ids_high = CASES[case]
    path = float64_sequence_onnx(name)
    with warnings.catch_warnings(), _one_torch_thread():
        warnings.simplefilter("ignore")
        model, onnx_name = _torch_model(name, path)
        arrays = _data(name, np.random.default_rng(2024), ids_high)
        loss, weights = _torch_step(name, model, arrays)
    data = tmp_path / "data.npz"
    np.savez(data, **arrays)

    plan = tmp_path / f"{strategy}-{ranks}.json"
    make_plan(path, plan, ranks, BATCH, strategy, RANDOM_SEED)
    args = ("--steps", "1", "--lr", str(LR), "--dtype", "float64", "--data", str(data))
    run = mpirun(plan, ranks, tmp_path, *args)
    where = f"{case} on {ranks} rank(s)"
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.losses) == 1, where
    loss_rtol, rtol, atol = ROUNDING_TOLERANCES.get(name, (LOSS_RTOL, RTOL, ATOL))
    np.testing.assert_allclose(run.losses[0], loss, rtol=loss_rtol, atol=0, err_msg=where)
    assert run.weights is not None
    # Every trainable weight saved once, under its initializer's name, and compared.
    assert set(run.weights) == set(onnx_name.values()), where
    for torch_name, want in weights.items():
        got = run.weights[onnx_name[torch_name]]
        np.testing.assert_allclose(
            got, want, rtol=rtol, atol=atol, err_msg=f"{where}: {onnx_name[torch_name]}"
        )
