# Every target sets itself up: a fresh clone needs only `make test` or `make bench`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast test-long examples-torch test-gpu lint docs bench bench-cuda bench-full example check clean conformance conformance-ci chaos soak fuzz size

# The optional extras (otel, prometheus) go in too: `make test` tests with them, and
# tests/integration/test_observe_absent.py runs workers with them hidden.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c .ci/constraints.txt -e '.[dev,otel,prometheus]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# No worker processes: the unit tests (no loop) and the one-process asyncio tests, about a
# minute (the whole `make test` takes about 10 minutes on 2 cores).
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/aio

# Jobs at a user's lengths, left out of `make test`: a torch-style ps/trainer job for
# 70 s and for 10 minutes (tests marked `long`), about 13 minutes in all.
test-long: $(STAMP)
	$(PY) -m pytest -q -m long

# The programs of pytorch/examples distributed/rpc at their own default lengths, torch and
# asyncrpc one after the other, results compared (tests marked `examples_full`, about 20
# minutes on a 2-core VM); each run's wall and CPU time go to examples-report.json.
examples-torch: $(STAMP)
	rm -f examples-report.json
	EXAMPLES_REPORT=examples-report.json $(PY) -m pytest -q -m examples_full \
		tests/integration/test_tutorials_full.py; status=$$?; cat examples-report.json; exit $$status

# The CUDA tests (tests/gpu); they skip without a GPU.
test-gpu: $(STAMP)
	$(PY) -m pytest -q tests/gpu

lint: $(STAMP)
	$(PY) -m ruff check asyncrpc tests examples bench docs/apidoc.py
	$(PY) -m ruff format --check asyncrpc tests examples bench docs/apidoc.py
	$(PY) -m mypy

# docs/reference.md, the API reference, written from the docstrings by docs/apidoc.py
# (tests/unit/test_reference.py fails when the checked-in file is stale).
docs: $(STAMP)
	$(PY) docs/apidoc.py

bench: $(STAMP)
	$(PY) -m asyncrpc.bench --quick

# CUDA tensors against torch, two processes on GPU 0 (says it skipped without a GPU).
bench-cuda: $(STAMP)
	$(PY) -m asyncrpc.bench --workloads cuda

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

# The chaos soak (asyncrpc/testing/chaos.py): 8 workers, mixed load, seeded faults, and a
# ledger audit at the end. `make chaos DURATION=600 SEED=7`; CI runs 30 s in `make test`.
DURATION ?= 600
SEED     ?= 1
chaos: $(STAMP)
	$(PY) -m asyncrpc.testing.chaos --duration $(DURATION) --seed $(SEED) --json chaos-report.json

# Off CI, the big numbers: a ledger of 10^6 operations with no faults (the chaos soak's
# load and audit; bounded by 40 minutes), 10^6 fuzz cases per wire target, and the size
# table (8, 16, 32 and 64 workers on this machine; see docs/scale.md).
CALLS        ?= 1000000
FUZZ_EXAMPLES ?= 1000000
SIZES        ?= 8 16 32 64
soak: $(STAMP)
	$(PY) -m asyncrpc.testing.chaos --no-faults --calls $(CALLS) --duration 2400 --json soak-report.json

fuzz: $(STAMP)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -o timeout=0 tests/unit/test_fuzz_wire.py

size: $(STAMP)
	$(PY) -m bench.size --sizes $(SIZES) --json size-report.json

example: $(STAMP)
	$(PY) -m examples.parameter_server

check: lint test conformance-ci

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache conformance-report.json examples-report.json chaos-report.json soak-report.json size-report.json
