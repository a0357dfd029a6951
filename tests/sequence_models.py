"""Sequence models the tests export to ONNX: transformers' GPT-2, BERT, ViT, T5 and BART,
and torch.nn's TransformerEncoder, LSTM and GRU, plus a LayerNorm-GELU MLP.

Tiny configs (width 16, 2 layers, 2 heads, vocabulary 64, 8 tokens), random init seeded
before the build, dropout configurable (default 0, attention dropout included). Torch and
transformers are imported inside the functions only: this module imports without them.

    path = export_sequence("gpt2", tmp_dir, "dynamo")     # build, seed, export
    model = SEQUENCE_MODELS["bert"].build(dropout=0.1)
    args = sequence_inputs("bert", batch=4)                # one tensor per input name

Every HF model is wrapped in a module whose ``forward`` takes the inputs positionally and
returns the logits only (``use_cache=False``; eager attention, which exports as explicit
MatMul/Softmax). Exports: ``legacy`` goes through ``tests/models.py``'s ``export`` (training
mode, no constant folding, opset 17); ``dynamo`` is exported here with ``optimize=False``
(the default optimizer may store a tied weight as two initializers), opset 18.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests.models import Exporter, export

if TYPE_CHECKING:
    import torch
    from torch import nn

VOCABULARY = 64
WIDTH = 16
LAYERS = 2
HEADS = 2
FFN = 32
TOKENS = 8
CLASSES = 5
IMAGE = 16  # ViT: 16x16 images, 4x4 patches -> 16 patches
PATCH = 4
FEATURES = 12  # GRU and MLP input features
ATTENTION = "eager"  # transformers' attention implementation


# --- transformers ------------------------------------------------------------------------


def _import_transformers() -> None:
    """Import transformers, which imports torchvision when it is installed: the CUDA
    torchvision wheel on a CPU-only torch fails unless ``import_torchvision`` stubs its meta
    registrations first (see ``tests/torchvision_models.py``)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        from tests.torchvision_models import import_torchvision

        import_torchvision()
    import transformers  # noqa: F401


def _logits_only(hf_model: nn.Module, arg_names: Sequence[str]) -> nn.Module:
    """``hf_model`` behind a forward that takes ``arg_names`` positionally and returns the
    logits only (``use_cache=False`` where the model's forward takes it)."""
    import inspect

    from torch import nn

    extra = {"return_dict": True}
    if "use_cache" in inspect.signature(hf_model.forward).parameters:
        extra["use_cache"] = False

    class LogitsOnly(nn.Module):
        # Named positional parameters, not *args: torch.export matches dynamic_shapes to them.
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_model

        def logits(self, *args):
            return self.model(**dict(zip(arg_names, args, strict=True)), **extra).logits

    class One(LogitsOnly):
        def forward(self, x0):
            return self.logits(x0)

    class Two(LogitsOnly):
        def forward(self, x0, x1):
            return self.logits(x0, x1)

    return {1: One, 2: Two}[len(arg_names)]()


def build_gpt2(seed: int = 0, dropout: float = 0.0):
    """GPT2LMHeadModel, LM head tied to the token embedding: ids [B, T] -> logits [B, T, V]."""
    import torch

    _import_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=TOKENS * 2,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=FFN,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        tie_word_embeddings=True,
        attn_implementation=ATTENTION,
    )
    torch.manual_seed(seed)
    return _logits_only(GPT2LMHeadModel(config), ("input_ids",))


def build_bert(seed: int = 0, dropout: float = 0.0):
    """BertForSequenceClassification: ids, attention_mask [B, T] int64 -> logits [B, C]."""
    import torch

    _import_transformers()
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCABULARY,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=TOKENS * 2,
        type_vocab_size=2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout=dropout,
        num_labels=CLASSES,
        attn_implementation=ATTENTION,
    )
    torch.manual_seed(seed)
    return _logits_only(BertForSequenceClassification(config), ("input_ids", "attention_mask"))


def build_vit(seed: int = 0, dropout: float = 0.0):
    """ViTForImageClassification: pixels [B, 3, 16, 16], 4x4 patches -> logits [B, C]."""
    import torch

    _import_transformers()
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=IMAGE,
        patch_size=PATCH,
        num_channels=3,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=CLASSES,
        attn_implementation=ATTENTION,
    )
    torch.manual_seed(seed)
    return _logits_only(ViTForImageClassification(config), ("pixel_values",))


def build_t5(seed: int = 0, dropout: float = 0.0):
    """T5ForConditionalGeneration: input_ids, decoder_input_ids [B, T] -> logits [B, T, V]."""
    import torch

    _import_transformers()
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCABULARY,
        d_model=WIDTH,
        d_kv=WIDTH // HEADS,
        d_ff=FFN,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=HEADS,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=dropout,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        use_cache=False,
        attn_implementation=ATTENTION,
    )
    torch.manual_seed(seed)
    return _logits_only(T5ForConditionalGeneration(config), ("input_ids", "decoder_input_ids"))


def build_bart(seed: int = 0, dropout: float = 0.0):
    """BartForConditionalGeneration: input_ids, decoder_input_ids [B, T] -> logits [B, T, V]."""
    import torch

    _import_transformers()
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCABULARY,
        d_model=WIDTH,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_position_embeddings=TOKENS * 2,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        classifier_dropout=dropout,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        use_cache=False,
        attn_implementation=ATTENTION,
    )
    torch.manual_seed(seed)
    return _logits_only(BartForConditionalGeneration(config), ("input_ids", "decoder_input_ids"))


# --- torch.nn ----------------------------------------------------------------------------


def build_transformer_encoder(seed: int = 0, dropout: float = 0.0):
    """ids [B, T] -> Embedding -> 2-layer TransformerEncoder (batch_first) -> mean over
    tokens -> Linear -> logits [B, C]."""
    import torch
    from torch import nn

    class EncoderClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCABULARY, WIDTH)
            layer = nn.TransformerEncoderLayer(
                WIDTH, HEADS, dim_feedforward=FFN, dropout=dropout, batch_first=True
            )
            # enable_nested_tensor=False: no fast path, no warning (batch_first, no mask).
            self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(ids)).mean(dim=1))

    torch.manual_seed(seed)
    return EncoderClassifier()


def build_lstm_lm(seed: int = 0, dropout: float = 0.0):
    """ids [B, T] -> Embedding -> 2-layer LSTM (batch_first) -> Linear -> logits [B, T, V]."""
    import torch
    from torch import nn

    class LSTMLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCABULARY, WIDTH)
            self.lstm = nn.LSTM(WIDTH, WIDTH, num_layers=LAYERS, batch_first=True, dropout=dropout)
            self.head = nn.Linear(WIDTH, VOCABULARY)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(self.embed(ids))
            return self.head(out)

    torch.manual_seed(seed)
    return LSTMLM()


def build_gru_classifier(seed: int = 0, dropout: float = 0.0):
    """x [B, T, F] float -> 2-layer GRU (batch_first) -> last step -> Linear -> logits [B, C]."""
    import torch
    from torch import nn

    class GRUClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(FEATURES, WIDTH, num_layers=LAYERS, batch_first=True, dropout=dropout)
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.gru(x)
            return self.head(out[:, -1])

    torch.manual_seed(seed)
    return GRUClassifier()


def build_mlp_ln_gelu(seed: int = 0, dropout: float = 0.0):
    """x [B, F] -> Linear -> LayerNorm -> GELU -> (Dropout) -> Linear -> logits [B, C]."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, FFN),
        nn.LayerNorm(FFN),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(FFN, CLASSES),
    )


# --- registry, inputs, export ------------------------------------------------------------


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]  # one sample, without the batch axis
    kind: str = "float"  # "float", "ids" (int64 below `high`, at least `low`), "mask"
    high: int = 0
    low: int = 0


@dataclass(frozen=True)
class SequenceSpec:
    build: Callable[..., nn.Module]  # build(seed=0, dropout=0.0)
    inputs: tuple[InputSpec, ...]
    output_name: str = "logits"


def _ids(name: str = "input_ids", low: int = 0) -> InputSpec:
    return InputSpec(name, (TOKENS,), "ids", high=VOCABULARY, low=low)


SEQUENCE_MODELS: dict[str, SequenceSpec] = {
    "gpt2": SequenceSpec(build_gpt2, (_ids(),)),
    "bert": SequenceSpec(build_bert, (_ids(), InputSpec("attention_mask", (TOKENS,), "mask"))),
    "vit": SequenceSpec(build_vit, (InputSpec("pixel_values", (3, IMAGE, IMAGE)),)),
    # ids >= 3 keep clear of the pad/eos/bos ids (0, 1, 2), which change the masks
    "t5": SequenceSpec(build_t5, (_ids(low=3), _ids("decoder_input_ids", low=3))),
    "bart": SequenceSpec(build_bart, (_ids(low=3), _ids("decoder_input_ids", low=3))),
    "transformer_encoder": SequenceSpec(build_transformer_encoder, (_ids(),)),
    "lstm_lm": SequenceSpec(build_lstm_lm, (_ids(),)),
    "gru_classifier": SequenceSpec(build_gru_classifier, (InputSpec("x", (TOKENS, FEATURES)),)),
    "mlp_ln_gelu": SequenceSpec(build_mlp_ln_gelu, (InputSpec("x", (FEATURES,)),)),
}


def sequence_inputs(name: str, batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """One random batch per input of model ``name``: floats normal, ids uniform in
    [low, high), masks int64 ones with the last sample's final two tokens padded (0)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = []
    for spec in SEQUENCE_MODELS[name].inputs:
        shape = (batch, *spec.shape)
        if spec.kind == "ids":
            out.append(torch.randint(spec.low, spec.high, shape, generator=generator))
        elif spec.kind == "mask":
            mask = torch.ones(shape, dtype=torch.int64)
            mask[-1, -2:] = 0
            out.append(mask)
        else:
            out.append(torch.randn(shape, generator=generator))
    return tuple(out)


def export_built(name: str, model: nn.Module, args: tuple, path: Path, exporter: Exporter):
    """Export a model built for ``name`` (inputs named as in its spec, output "logits");
    dynamo with ``optimize=False``, which keeps tied weights as one initializer."""
    spec = SEQUENCE_MODELS[name]
    return export(
        model,
        args,
        path,
        exporter,
        input_names=tuple(i.name for i in spec.inputs),
        output_names=(spec.output_name,),
        optimize=False,
    )


def export_sequence(
    name: str,
    directory: Path | str,
    exporter: Exporter = "legacy",
    batch: int = 2,
    *,
    seed: int = 0,
    dropout: float = 0.0,
) -> Path:
    """Build model ``name`` of ``SEQUENCE_MODELS`` and export it to
    ``directory/<name>_<exporter>.onnx`` (inputs named as in the spec, output "logits")."""
    model = SEQUENCE_MODELS[name].build(seed=seed, dropout=dropout)
    path = Path(directory) / f"{name}_{exporter}.onnx"
    return export_built(name, model, sequence_inputs(name, batch), path, exporter)
