# Two commands for a newcomer: `make demo` (a real training run) and `make test` (the test suite).
# Each creates or updates the virtual environment in .venv itself.

PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.fabric-installed

.PHONY: venv demo test check horovod bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,test-storage,examples,tensorboard,mpi,bitsandbytes]"
	touch $(STAMP)

venv: $(STAMP)

## The main job: the example training run as a 2-process DDP job on the CPU.
demo: venv
	$(PYTHON) examples/digits/train_fabric.py --accelerator cpu --devices 2 --strategy ddp

## Lint (ruff: the package, tests, benchmarks and examples) and type checks (mypy: the package); configured in pyproject.toml.
check: venv
	$(VENV)/bin/ruff check fabric tests benchmarks examples scripts
	$(VENV)/bin/mypy

## The checks, then the test suite: serially, or in TEST_WORKERS pytest-xdist processes (same result; see
## the README); Horovod tests run when Horovod is installed: see `make horovod`.
TEST_WORKERS ?= 0
test: check
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS)

## Build Horovod 0.28.1 for torch >= 2.1 (about 5 minutes once, cached after) into the venv.
horovod: venv
	PY=$(PYTHON) bash scripts/build_horovod.sh

bench: venv
	$(PYTHON) benchmarks/import_cost.py
	$(PYTHON) benchmarks/step_overhead.py
	$(PYTHON) benchmarks/ddp_step.py
	$(PYTHON) benchmarks/launch.py
	$(PYTHON) benchmarks/checkpoint.py

## The GPU check: every CUDA test and the GPU benchmarks, results in OUT (gpu-check.json, junit.xml). No venv: the
## python3 on PATH with torch; this checkout goes first on PYTHONPATH, before the caller's (which supplies isal if needed).
gpu-check:
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=<folder> [GPU_CHECK_ARGS='--workers 4']" >&2; exit 2; }
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS) "$(OUT)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
