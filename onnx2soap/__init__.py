"""onnx2soap: SOAP parallelization plans for ONNX models, found by simulation and search."""

__version__ = "0.1.0"
