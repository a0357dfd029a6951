#!/usr/bin/env bash
# The GPU checks, as one prepared run on a machine with a CUDA GPU (and cupy, onnx,
# onnxruntime, pytest there): cupy kernels against numpy per task, then the kernel
# timing table. Results go to $OUT (or ./build/gpu when OUT is unset).
set -u
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
PY=${PYTHON:-python3}
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import sys, cupy, numpy, onnx, onnxruntime; print(sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'onnx', onnx.__version__, 'onnxruntime', onnxruntime.__version__)"
  lscpu | grep 'Model name'
} 2>&1 | tee "$OUT/machine.txt"
$PY -m pytest -q -p no:cacheprovider tests/ops/test_ops_gpu.py tests/conformance/test_backend.py 2>&1 | tail -n 5 | tee "$OUT/gpu_tests.txt"
$PY -m benchmarks.kernels --batch 256 --repeat 20 2>&1 | tee "$OUT/kernels.txt"
