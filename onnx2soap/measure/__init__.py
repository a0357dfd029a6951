"""Measuring: runs the executor's kernels and links under MPI, writes what planning reads.

- ``probe.py`` (``onnx2soap machine probe``, ``python -m onnx2soap.measure.probe``): this
  host's MPI ranks into a machine file; ``probe_messages.py``: what a message and a ring
  step cost the executor's runtime;
- ``profiler.py`` (``onnx2soap profile``, ``python -m onnx2soap.measure.profiler``): a
  model's tasks timed with the executor's kernels into a cost database;
- ``cost_writer.py``: the cost database opened for writing.

This package sits above the simulator and the executor and imports both; neither imports
it. The simulator only reads what it writes (``sim/costdb.py``, ``sim/machine.py``).
"""
