"""``--save-weights W.safetensors`` of a Hugging Face model: torch loads the file into
the module the ONNX model was exported from, every name one of its parameters (dynamo,
``optimize=False``: the initializers are the module's parameters, the tied LM head once),
and gets the executor's trained weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from executor.kinds import DeviceKind
from executor.train import RunOptions, train
from onnx2soap.cli import main as onnx2soap_main
from onnx2soap.ir import DType
from tests.sequences.conftest import DROPOUT


def test_gpt2_weights_load_into_the_torch_model(sequence_onnx, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from tests.sequence_models import SEQUENCE_MODELS

    model = sequence_onnx("gpt2", "dynamo")
    plan = tmp_path / "one.json"
    argv = ["plan", str(model), "--devices", "1", "--batch", "2", "--quiet", "-o", str(plan)]
    assert onnx2soap_main(argv) == 0
    out = tmp_path / "gpt2.safetensors"
    options = RunOptions(
        plan=plan, steps=2, lr=0.05, dtype=DType.FLOAT32, device=DeviceKind.CPU, save_weights=out
    )
    trained = train(MPI.COMM_SELF, options, gather=True).weights
    saved = load_file(out)
    assert set(saved) == set(trained)
    module = SEQUENCE_MODELS["gpt2"].build(seed=1, dropout=DROPOUT)  # other values, replaced
    missing, unexpected = module.load_state_dict(saved, strict=False)
    assert not unexpected
    # the LM head is the token embedding, saved once (under the name the export gave it)
    tied = {"model.lm_head.weight", "model.transformer.wte.weight"}
    assert len(missing) == 1 and set(missing) < tied and len(tied & set(saved)) == 1
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    for name, tensor in module.state_dict().items():
        if name in trained:
            np.testing.assert_array_equal(tensor.numpy(), trained[name], err_msg=name)
    (embedding,) = tied & set(saved)
    assert torch.equal(module.model.transformer.wte.weight.detach(), saved[embedding])
