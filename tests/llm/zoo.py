"""The model families of issue 29, built from configs (no network) and exported as users
export them: Llama, Mistral and Qwen2 decoders, RoBERTa (masked LM), a Conv1d+GroupNorm
audio classifier, T5 and BART fed their labels (the decoder's shift-right is integer
computation inside the graph), and torch.nn's Transformer, time-major inside.

Tiny configs (width 16, 2 layers, vocabulary 64, 8 tokens), random init seeded before the
build, no dropout. Torch and transformers are imported inside the functions only.

    spec = FAMILIES["llama"]
    model = spec.build()                       # a torch module, float32, seeded
    path = export_family("llama", directory)   # the exporter and settings the family needs

Every family exports with the dynamo exporter, ``optimize=False`` (the optimizer may store
a tied weight as two initializers), a dynamic batch, opset 18; HF decoders with
``use_cache=False`` and ``attn_implementation="eager"`` (SDPA exports as a fused op).
Families with ``legacy=True`` also export with the legacy exporter (training mode).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests.models import Exporter, export

if TYPE_CHECKING:
    import torch
    from torch import nn

VOCABULARY = 64
WIDTH = 16
HEADS = 4
KV_HEADS = 2  # grouped-query attention: each key/value head serves two query heads
LAYERS = 2
FFN = 32
TOKENS = 8
CLASSES = 5
SAMPLES = 400  # audio: samples per clip
PAD = 1  # RoBERTa's and BART's padding id; T5's is 0


def _import_transformers() -> None:
    """transformers imports torchvision when installed: stub its meta registrations first
    (a CUDA torchvision wheel on a CPU-only torch fails otherwise)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        from tests.torchvision_models import import_torchvision

        import_torchvision()
    import transformers  # noqa: F401


def _logits(hf_model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """``hf_model`` behind a forward taking ``names`` positionally, returning the logits."""
    from torch import nn

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_model

        def logits(self, *args):
            return self.model(**dict(zip(names, args, strict=True)), return_dict=True).logits

    class One(Logits):
        def forward(self, x0):
            return self.logits(x0)

    class Two(Logits):
        def forward(self, x0, x1):
            return self.logits(x0, x1)

    return {1: One, 2: Two}[len(names)]()


# --- decoders ----------------------------------------------------------------------------


def _decoder(kind: str, seed: int):
    """LlamaForCausalLM and its relatives: rotary positions, RMSNorm, grouped-query
    attention, a SiLU-gated MLP; ids [B, T] -> logits [B, T, V]."""
    import torch

    _import_transformers()
    import transformers

    config_class, model_class, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
        # Qwen2's q/k/v projections have biases
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    }[kind]
    config = getattr(transformers, config_class)(
        vocab_size=VOCABULARY,
        hidden_size=WIDTH,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=TOKENS * 2,
        use_cache=False,
        attn_implementation="eager",
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    return _logits(model, ("input_ids",))


def build_llama(seed: int = 0):
    return _decoder("llama", seed)


def build_mistral(seed: int = 0):
    return _decoder("mistral", seed)


def build_qwen2(seed: int = 0):
    return _decoder("qwen2", seed)


# --- RoBERTa -----------------------------------------------------------------------------


def build_roberta(seed: int = 0):
    """RobertaForMaskedLM: ids, attention_mask [B, T] -> logits [B, T, V]. Its position ids
    are computed from the ids: a running count of the tokens that are not padding, plus the
    padding id (integer computation on the data)."""
    import torch

    _import_transformers()
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(
        vocab_size=VOCABULARY,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=TOKENS + PAD + 1,
        type_vocab_size=1,
        pad_token_id=PAD,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return _logits(RobertaForMaskedLM(config), ("input_ids", "attention_mask"))


# --- audio -------------------------------------------------------------------------------


def build_audio(seed: int = 0):
    """waveform [B, 1, 400] -> Conv1d -> GroupNorm(4 groups) -> GELU -> Conv1d ->
    GroupNorm(one group per channel, wav2vec2's) -> GELU -> mean over time -> Linear ->
    logits [B, 5]."""
    import torch
    from torch import nn

    class AudioClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv1d(1, 8, 9, stride=4)
            self.norm1 = nn.GroupNorm(4, 8)
            self.conv2 = nn.Conv1d(8, WIDTH, 5, stride=2)
            self.norm2 = nn.GroupNorm(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = nn.functional.gelu(self.norm1(self.conv1(x)))
            x = nn.functional.gelu(self.norm2(self.conv2(x)))
            return self.head(x.mean(dim=-1))

    torch.manual_seed(seed)
    return AudioClassifier()


# --- encoder-decoders fed their labels ---------------------------------------------------


def build_t5(seed: int = 0):
    """T5ForConditionalGeneration given ``labels``: the decoder's inputs are the labels
    shifted right (start id in front, -100 replaced by the padding id), computed in the
    graph; input_ids, labels [B, T] -> logits [B, T, V]."""
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
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return _logits(T5ForConditionalGeneration(config), ("input_ids", "labels"))


def build_bart(seed: int = 0):
    """BartForConditionalGeneration given ``labels`` (shifted right in the graph, as T5's):
    input_ids, labels [B, T] -> logits [B, T, V]."""
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
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return _logits(BartForConditionalGeneration(config), ("input_ids", "labels"))


# --- torch.nn.Transformer ----------------------------------------------------------------


def build_transformer(seed: int = 0):
    """src ids [B, S], tgt ids [B, T] -> embeddings, turned time-major ([T, B, E], torch's
    default layout) -> nn.Transformer (batch_first=False, causal target mask) -> back to
    [B, T, E] -> Linear -> logits [B, T, V]. Inside, nn.MultiheadAttention reshapes its
    projections to [T, B * heads, head] and back: the batch moves off axis 0."""
    import torch
    from torch import nn

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCABULARY, WIDTH)
            self.transformer = nn.Transformer(
                d_model=WIDTH,
                nhead=HEADS,
                num_encoder_layers=LAYERS,
                num_decoder_layers=LAYERS,
                dim_feedforward=FFN,
                dropout=0.0,
            )
            self.head = nn.Linear(WIDTH, VOCABULARY)
            mask = nn.Transformer.generate_square_subsequent_mask(TOKENS)
            self.register_buffer("causal", mask, persistent=False)

        def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            s = self.embed(src).transpose(0, 1)
            t = self.embed(tgt).transpose(0, 1)
            out = self.transformer(s, t, tgt_mask=self.causal, tgt_is_causal=True)
            return self.head(out.transpose(0, 1))

    torch.manual_seed(seed)
    return Seq2Seq()


# --- registry, inputs, export ------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    name: str
    shape: tuple[int, ...]  # one sample, without the batch axis
    kind: str = "ids"  # "ids" (int64 in [low, VOCABULARY)), "mask" (int64 0/1), "float"
    low: int = 0


@dataclass(frozen=True)
class Family:
    build: Callable[..., nn.Module]  # build(seed=0): float32, train mode off, seeded
    inputs: tuple[Input, ...]
    tokens: bool  # logits [B, T, V] with labels [B, T]; else [B, C] with labels [B]
    legacy: bool = False  # the legacy exporter exports it too
    transformers: bool = True  # needs the transformers package


def _ids(name: str = "input_ids", low: int = 0) -> Input:
    return Input(name, (TOKENS,), "ids", low)


FAMILIES: dict[str, Family] = {
    "llama": Family(build_llama, (_ids(),), tokens=True),
    "mistral": Family(build_mistral, (_ids(),), tokens=True),
    "qwen2": Family(build_qwen2, (_ids(),), tokens=True),
    # ids >= 3 keep clear of the special ids (0-2) except where padding is meant
    "roberta": Family(
        build_roberta,
        (_ids(low=3), Input("attention_mask", (TOKENS,), "mask")),
        tokens=True,
        legacy=True,
    ),
    "audio": Family(
        build_audio,
        (Input("waveform", (1, SAMPLES), "float"),),
        tokens=False,
        legacy=True,
        transformers=False,
    ),
    "t5": Family(build_t5, (_ids(low=3), _ids("target_ids", low=3)), tokens=True),
    "bart": Family(build_bart, (_ids(low=3), _ids("target_ids", low=3)), tokens=True),
    "transformer": Family(
        build_transformer, (_ids("src"), _ids("tgt")), tokens=True, transformers=False
    ),
}


def example_inputs(name: str, batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """One random batch per input of family ``name`` (the export's example)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = []
    for spec in FAMILIES[name].inputs:
        shape = (batch, *spec.shape)
        if spec.kind == "ids":
            out.append(torch.randint(spec.low, VOCABULARY, shape, generator=generator))
        elif spec.kind == "mask":
            mask = torch.ones(shape, dtype=torch.int64)
            mask[-1, -2:] = 0
            out.append(mask)
        else:
            out.append(torch.randn(shape, generator=generator))
    return tuple(out)


def export_family(
    name: str, directory: Path | str, exporter: Exporter = "dynamo", *, seed: int = 0
) -> Path:
    """Build family ``name`` in float64 and export it to ``directory/<name>_<exporter>.onnx``:
    every initializer and nearly every constant float64, so that one step of it compares
    with torch's in float64."""
    import torch

    model = FAMILIES[name].build(seed=seed).double()
    args = tuple(a.to(torch.float64) if a.is_floating_point() else a for a in example_inputs(name))
    path = Path(directory) / f"{name}_{exporter}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' notes on tracing and training mode
        return export(
            model,
            args,
            path,
            exporter,
            input_names=tuple(i.name for i in FAMILIES[name].inputs),
            output_names=("logits",),
            optimize=False,
        )
