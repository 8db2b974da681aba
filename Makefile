# Every target sets itself up: a fresh clone needs only `make test` or `make bench`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast test-gpu lint bench bench-cuda bench-full example check clean conformance conformance-ci

$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c .ci/constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# No worker processes: the unit tests (no loop) and the one-process asyncio tests, under 30 s.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/aio

# The CUDA tests (tests/gpu); they skip without a GPU.
test-gpu: $(STAMP)
	$(PY) -m pytest -q tests/gpu

lint: $(STAMP)
	$(PY) -m ruff check asyncrpc tests examples bench
	$(PY) -m ruff format --check asyncrpc tests examples bench
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m asyncrpc.bench --quick

# CUDA tensors against torch, two processes on GPU 0 (says it skipped without a GPU).
bench-cuda: $(STAMP)
	$(PY) bench/cuda_bench.py

bench-full: $(STAMP)
	$(PY) -m asyncrpc.bench --json bench/results.json

# torch's own RPC test suites against asyncrpc, core (RpcTest and its examples) and
# extended (distributed autograd, DistributedOptimizer, DDP under distributed autograd,
# RemoteModule); see tests/conformance/. Fails on a failure not in expected_failures.txt
# and on a listed pass.
conformance: $(STAMP)
	$(PY) -m tests.conformance.run --suites all --json conformance-report.json

# The fixed subset CI runs (tests/conformance/ci_subset.txt, about a minute).
conformance-ci: $(STAMP)
	$(PY) -m tests.conformance.run --suites all --ci --json conformance-report.json

example: $(STAMP)
	$(PY) -m examples.parameter_server

check: lint test conformance-ci

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache conformance-report.json
