# Two commands for a newcomer: `make demo` (a real training run) and `make test` (the test suite).
# Each creates or updates the virtual environment in .venv itself.

PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# what each command needs: the demo the package and the example's extras; the tests every extra they exercise
DEMO_STAMP := $(VENV)/.fabric-demo
TEST_STAMP := $(VENV)/.fabric-test

.PHONY: venv demo test test-fast test-ray coverage check horovod bench gpu-check clean

$(PYTHON):
	$(PY) -m venv $(VENV)

$(DEMO_STAMP): pyproject.toml constraints.txt | $(PYTHON)
	$(PIP) -e ".[examples]"
	touch $(DEMO_STAMP)

$(TEST_STAMP): pyproject.toml constraints.txt | $(PYTHON)
	$(PIP) -e ".[test,test-storage,examples,tensorboard,mpi,bitsandbytes,ft]"
	touch $(TEST_STAMP) $(DEMO_STAMP)

venv: $(TEST_STAMP)

## The main job: the example training run as a 2-process DDP job on the CPU. ARGS go to the script:
## `make demo ARGS=--resume` continues the last run, `make demo ARGS='--resume --epochs 12'` trains it on.
demo: $(DEMO_STAMP)
	$(PYTHON) examples/digits/train_fabric.py --accelerator cpu --devices 2 --strategy ddp $(ARGS)

## Lint (ruff: the package, tests, benchmarks and examples) and type checks (mypy: the package); configured in pyproject.toml.
check: venv
	$(VENV)/bin/ruff check fabric tests benchmarks examples scripts
	$(VENV)/bin/mypy

## The checks, then the test suite: every test but the `timing` ones in TEST_WORKERS pytest-xdist processes (one per
## core), then the `timing` ones alone, one at a time; each tier lists its slowest tests (where the suite's time
## goes). Horovod tests run when Horovod is installed (`make horovod`). The sources are byte-compiled first: with
## PYTHONDONTWRITEBYTECODE set, every process a test starts would compile what it imports (0.13 s of CPU for a rank).
TEST_WORKERS ?= auto
test: check
	$(PYTHON) -m compileall -q fabric tests examples
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) -m "not timing" --durations=25
	$(PYTHON) -m pytest -q -m timing --durations=15

## The loop to run after every edit: every test that starts no process (how long: README, "Two commands").
test-fast: venv
	$(PYTHON) -m pytest -q -m "not procs"

## The Ray Train recipe (docs/ray.md): installs the `ray` extra (about 160 MB, so not part of `make test`), then runs
## tests/test_ray_train.py: a worker SIGKILLed under TorchTrainer, the restarted job's losses equal to an uninterrupted run's.
test-ray: venv
	$(PIP) -e ".[ray]"
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/test_ray_train.py

## Line coverage of fabric/, the processes the tests start included (coverage.py's subprocess patch): the tests as
## `make test` runs them (the `timing` ones alone, after); the report (htmlcov/ and the screen) even if a test failed,
## then the tests' status.
coverage: venv
	rm -rf .coverage-data && mkdir -p .coverage-data
	status=0; \
	$(VENV)/bin/coverage run -m pytest -q -n $(TEST_WORKERS) -m "not timing" -p no:cacheprovider || status=1; \
	$(VENV)/bin/coverage run -m pytest -q -m timing -p no:cacheprovider || status=1; \
	$(VENV)/bin/coverage combine -q; \
	$(VENV)/bin/coverage report --format=total | sed 's/^/line coverage of fabric\/ (%): /'; \
	$(VENV)/bin/coverage html -q; \
	exit $$status

## Build Horovod 0.28.1 for torch >= 2.1 into the venv: once (docs/switching.md says how long), cached after.
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
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .coverage-data htmlcov
