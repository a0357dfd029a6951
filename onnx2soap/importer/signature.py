"""What torch.export's graph signature says about the initializers.

The dynamo exporter writes every initializer the same way, parameters and buffers alike,
and records torch.export's graph signature in the graph's metadata: each lifted input
with its kind and target. A buffer (rotary position frequencies, BART's final logits
bias, a causal mask) or a lifted constant is read by the model and never trained by
torch: the importer gives such a float initializer the role of a constant.
"""

from __future__ import annotations

import re

import onnx

SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"
# "b_model_rotary_emb_inv_freq: BUFFER target='model.rotary_emb.inv_freq' persistent=False"
_NOT_TRAINED = re.compile(r": (?:BUFFER|CONSTANT_TENSOR) target='([^']*)'")


def untrained_initializers(model: onnx.ModelProto) -> frozenset[str]:
    """The initializers the exporter's graph signature lists as buffers or constants;
    empty for a model without one (the legacy exporter's, other frameworks')."""
    for prop in model.graph.metadata_props:
        if prop.key == SIGNATURE_KEY:
            return frozenset(_NOT_TRAINED.findall(prop.value))
    return frozenset()
