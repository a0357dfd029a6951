# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean plans

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python examples/demo.py

# pytest twice: the whole suite (GPU tests real on a GPU, skipped without one), then the
# GPU tests again under the numpy stand-in for CuPy and NCCL (tests/standins, first on
# the path, reaching mpiexec's ranks too), so every --device cuda path runs on any machine.
# The stand-in has four GPUs whatever CUDA_VISIBLE_DEVICES says on a GPU machine.
test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/ruff check .
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/ruff format --check .
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q
	env -u CUDA_VISIBLE_DEVICES PATH="$(CURDIR)/$(BIN):$$PATH" \
		PYTHONPATH="$(CURDIR)/tests/standins" $(BIN)/python -m pytest -q -m gpu

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis

# The committed example plans (reproducible: searches stop on --max-evals).
PLAN = $(BIN)/onnx2soap plan examples/cnn.onnx --batch 32
plans: $(STAMP)
	$(PLAN) --machine cpu:4 --max-evals 2000 --budget 600 --seed 0 -o plans/example.json
	$(PLAN) --devices 4 --strategy data-parallel -o plans/cnn-data-parallel-4.json
	$(PLAN) --devices 4 --strategy expert -o plans/cnn-expert-4.json
	$(PLAN) --devices 4 --strategy random --seed 1 -o plans/cnn-random-4.json
	$(PLAN) --machine flexflow-p100:4 --max-evals 3000 --budget 600 --seed 0 -o plans/cnn-p100x4-mcmc.json
