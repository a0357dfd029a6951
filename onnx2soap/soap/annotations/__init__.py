"""Plans as ONNX multi-device annotations (IR version 11: ``ModelProto.configuration``,
``NodeProto.device_configurations`` with a ``ShardingSpecProto`` per input and output
and a pipeline stage), written and read.

    annotated = annotate(model_proto, plan, graph, space, out.parent)   # write.py
    refer_to_data(annotated, plan.model_path, out); write_annotated(annotated, out)
    plan = read_annotated(path, lambda batch, loss: load_model(path, batch, loss))

``sharding.py`` states one op's config in the standard's terms, ``layout.py`` a node's,
``proto.py`` converts to and from the protos, ``nodes.py`` matches ops to nodes,
``metadata.py`` keeps what the standard cannot say, ``parse.py`` checks a file's fields,
``read.py`` reads our files back, ``foreign.py`` another tool's, whose op configs
``derive.py`` makes from the shardings.
"""

from onnx2soap.soap.annotations.read import (
    Loaded,
    Loader,
    is_annotated_model,
    load_proto,
    read_annotated,
)
from onnx2soap.soap.annotations.write import annotate, refer_to_data, write_annotated

__all__ = [
    "Loaded",
    "Loader",
    "annotate",
    "is_annotated_model",
    "load_proto",
    "read_annotated",
    "refer_to_data",
    "write_annotated",
]
