#!/usr/bin/env bash
# The GPU checks, as one prepared run (about 14 minutes at most, each part capped; a
# shorter limit keeps the parts that finished) on a machine with a CUDA GPU and cupy,
# torch, mpi4py (with mpiexec), onnx, onnxruntime and pytest:
#   1. every op's cupy kernels equal numpy's (float64), and the backend on cupy;
#   2. the executor on the GPU: one rank like the CPU, four ranks sharing the GPU over
#      mpi-host like one device, nccl with one rank, mpi-cuda run or refused, fp16 and
#      bf16 mixed precision like the CPU's (fp16 products on tensor cores), ZeRO, pipelines
#      (GPipe, 1F1B: Reopen's waits on a real stream) and recomputation over ranks sharing
#      the GPU (host-staged; NCCL's cases need a GPU per rank);
#   3. the step-time table: the executor next to PyTorch eager on the same GPU;
#   4. four ranks sharing the GPU: measured step next to the simulator's prediction;
#   5. the per-op kernel table, numpy vs cupy;
#   6. simulator fidelity with 2 and 4 ranks sharing the GPU: profiled on the GPU (kernels
#      and in-step calibration), ten plans a model predicted next to measured.
# Part 6 takes its models from build/fidelity-models, exported beforehand where torch and
# transformers are (this project's venv), and carried to the GPU's machine:
#   python -m benchmarks.fidelity --export-only --models-dir build/fidelity-models
# Each part has its own time limit, so one stuck part leaves the others' results; the
# parts run in order of what matters most, and print as they go. Results go to $OUT (or
# ./build/gpu when OUT is unset). Arguments name the parts to run (default: all), so that
# a device's time can be split over two calls: `gpu_check.sh 1 2 3 4 5`, then `gpu_check.sh 6`.
# Part 6 prints each model's row and rewrites its JSON as the model ends, so a run its
# time limit cuts keeps what it finished. A dry run without a GPU, under the numpy
# stand-in for CuPy and NCCL (figures meaningless; part 3 needs torch built for CUDA):
#   PYTHONPATH=tests/standins OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -u
PARTS=" ${*:-1 2 3 4 5 6} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PATH="$(dirname "$(command -v "$PY")"):$PATH"
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import sys, cupy, numpy, onnx, onnxruntime, torch; print(sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'onnx', onnx.__version__, 'onnxruntime', onnxruntime.__version__, 'torch', torch.__version__)"
  $PY -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
  command -v mpiexec || echo "no mpiexec on PATH"
  lscpu | grep 'Model name'
} 2>&1 | tee "$OUT/machine.txt"
if part 1; then
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/ops/test_ops_gpu.py \
    tests/conformance/test_backend.py 2>&1 | tail -n 5 | tee "$OUT/gpu_ops.txt"
fi
if part 2; then
  timeout 300 $PY -m pytest -q -p no:cacheprovider -rs tests/executor/test_gpu.py \
    tests/cli/test_profile_gpu.py tests/executor/test_precision_gpu.py \
    "tests/executor/test_zero.py::test_zero_on_gpus_trains_like_one_device" \
    "tests/executor/test_pipeline.py::test_a_pipeline_on_gpus_trains_like_one_device" \
    "tests/executor/test_recompute.py::test_ranks_sharing_a_gpu_recompute_like_one_device" \
    2>&1 | tail -n 15 | tee "$OUT/gpu_executor.txt"
fi
if part 3; then
  timeout 90 $PY -m benchmarks.step_time --device cuda --steps 20 2>&1 \
    | grep -v Warning | tail -n 4 | tee "$OUT/step_time.txt"
fi
if part 4; then
  timeout 90 $PY -m benchmarks.multirank --device cuda --ranks 4 --steps 10 2>&1 \
    | tail -n 6 | tee "$OUT/multirank.txt"
fi
if part 5; then
  timeout 45 $PY -m benchmarks.kernels --batch 256 --repeat 20 2>&1 | tee "$OUT/kernels.txt"
fi
if part 6; then
  timeout 200 $PY -m benchmarks.fidelity --device cuda --ranks 2 4 --repeats 2 \
    --models cnn,gpt2,lstm_lm,resnet18 --models-dir build/fidelity-models \
    --json "$OUT/fidelity.json" 2>&1 \
    | tee "$OUT/fidelity.txt"
fi
