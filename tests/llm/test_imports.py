"""Issue 29's families import as exported (``tests/llm/zoo.py``): what torch never trains
stays untrained, and the batch is traced wherever it lands.

- The exporter's buffers (rotary frequencies, BART's final logits bias) are constants.
- nn.Transformer's attention, time-major inside ([T, N, E] reshaped to [T, N*H, D]),
  splits by batch from end to end: the reshape merging the batch with the heads keeps
  it as a sample dim, split in whole blocks of heads.
- A time-major attention exported with a static batch imports at that batch, and at
  another is refused at the Reshape that fixes it, saying which batch it was made for.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from onnx2soap.errors import ModelError
from onnx2soap.importer import load_model
from onnx2soap.ir import TensorRole
from onnx2soap.soap import DimKind, analyze
from tests.llm.zoo import HEADS, TOKENS, VOCABULARY, WIDTH

BATCH = 4
CASES = [
    ("llama", "dynamo"),
    ("mistral", "dynamo"),
    ("qwen2", "dynamo"),
    ("roberta", "dynamo"),
    ("roberta", "legacy"),
    ("audio", "dynamo"),
    ("audio", "legacy"),
    ("t5", "dynamo"),
    ("bart", "dynamo"),
    ("transformer", "dynamo"),
]
# Buffers torch never trains, which the dynamo exporter writes as initializers.
BUFFERS = {
    "llama": {"model.model.rotary_emb.inv_freq"},
    "mistral": {"model.model.rotary_emb.inv_freq"},
    "qwen2": {"model.model.rotary_emb.inv_freq"},
    "bart": {"model.final_logits_bias"},
}


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_imports_buffers_untrained_batch_everywhere(llm_onnx, case: tuple[str, str]) -> None:
    """The exporter's buffers are constants; every op computed from the data (integer
    ones included) has a sample dim: the batch is traced through every layout change; and
    every attention's scores split by batch."""
    name, exporter = case
    graph = load_model(llm_onnx(name, exporter), BATCH).graph
    assert graph.loss_op is not None and graph.weights
    for buffer in BUFFERS.get(name, set()):
        assert graph.tensors[buffer].role is TensorRole.CONSTANT, buffer
    space = analyze(graph)
    lost = [
        (op.name, op.type)
        for op in graph.ops
        if graph.tensors[op.output].batched
        and not any(d.kind is DimKind.SAMPLE for d in space[op.name])
    ]
    assert not lost, f"the batch is lost at {lost[:5]}"
    for op in graph.ops:
        if op.type == "Softmax":
            first = space[op.name][0]
            assert first.kind is DimKind.SAMPLE and first.splittable, (op.name, first)


def test_time_major_attention_splits_by_batch(llm_onnx) -> None:
    """nn.MultiheadAttention reshapes its projections [T, N, E] to [T, N*H, D]: the merged
    axis is a sample dim split in whole blocks of H, and every op of the attention after
    it, transposed to [N*H, T, D] and split to [N, H, T, D], keeps the batch."""
    graph = load_model(llm_onnx("transformer"), BATCH).graph
    space = analyze(graph)
    head = WIDTH // HEADS
    merges = [
        op
        for op in graph.ops
        if op.type == "Reshape"
        and graph.tensors[op.inputs[0]].shape == (TOKENS, BATCH, WIDTH)
        and graph.tensors[op.output].shape == (TOKENS, BATCH * HEADS, head)
    ]
    assert len(merges) >= 6, "q, k and v of each of the encoder's and decoder's layers"
    for op in merges:
        t, merged, d = space[op.name]
        assert merged.kind is DimKind.SAMPLE and merged.splittable, (op.name, merged)
        assert merged.granule == HEADS and not d.splittable and t.kind is DimKind.ATTRIBUTE
    fused = [op for op in graph.ops if op.type == "Attention"]
    assert len(fused) == 6, "the encoder's, decoder's and cross attention, fused"
    for op in fused:  # [N, H, T, D]
        first = space[op.name][0]
        assert first.kind is DimKind.SAMPLE and first.splittable, (op.name, first)


def _time_major_attention(seed: int = 0):
    """ids [N, T] -> Embedding -> [T, N, E] -> nn.MultiheadAttention -> mean over time ->
    Linear -> logits [N, 5]."""
    import torch
    from torch import nn

    class TimeMajorAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCABULARY, WIDTH)
            self.attention = nn.MultiheadAttention(WIDTH, HEADS, dropout=0.0)
            self.head = nn.Linear(WIDTH, 5)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids).transpose(0, 1)
            y, _ = self.attention(x, x, x, need_weights=False)
            return self.head(y.mean(dim=0))

    torch.manual_seed(seed)
    return TimeMajorAttention()


@pytest.fixture(scope="module")
def static_attention(tmp_path_factory: pytest.TempPathFactory):
    """``get(exporter)`` -> the time-major attention exported with its batch fixed at 2."""
    pytest.importorskip("torch")
    import torch

    from tests.models import export

    directory = tmp_path_factory.mktemp("static_attention")
    cache: dict[str, Path] = {}

    def get(exporter: str) -> Path:
        if exporter not in cache:
            seeded = torch.Generator().manual_seed(1)
            ids = torch.randint(0, VOCABULARY, (2, TOKENS), generator=seeded)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[exporter] = export(
                    _time_major_attention(),
                    ids,
                    directory / f"attention_{exporter}.onnx",
                    exporter,
                    input_names=("ids",),
                    output_names=("logits",),
                    dynamic_batch=False,
                    optimize=False,
                )
        return cache[exporter]

    return get


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_static_time_major_export_imports_at_its_batch(static_attention, exporter: str) -> None:
    graph = load_model(static_attention(exporter), 2).graph
    space = analyze(graph)
    (attention,) = (op for op in graph.ops if op.type == "Attention")
    assert space[attention.name][0].kind is DimKind.SAMPLE


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_static_time_major_export_at_another_batch_is_refused(static_attention, exporter) -> None:
    with pytest.raises(ModelError) as err:
        load_model(static_attention(exporter), BATCH)
    message = str(err.value)
    assert "(Reshape)" in message and "written in the file, fixes the batch at 2" in message
    assert "dynamic batch axis" in message and "--batch 2" in message
