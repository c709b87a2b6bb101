# kvtier: `make run` starts the daemon on the embedded default, `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
DATA_DIR ?= ./data

.PHONY: run test test-slow test-all lint test-engines perf clean-venv cluster nixl soak

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# the daemon alone (its extra: admin API, metrics): no GPU stack, no torch
$(VENV)/.run-deps: $(PY) pyproject.toml
	$(PIP) install -e '.[daemon]'
	touch $@

# torch==2.13.0 first: a plain `torch` requirement would pull a multi-GB CUDA build
$(VENV)/.test-deps: $(PY) pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	touch $@

# the daemon with the NIXL transport (docs/nixl.md): torch==2.13.0 first, as for the tests, or
# nixl-cu12's unpinned torch requirement pulls a multi-GB CUDA build
$(VENV)/.nixl-deps: $(PY) pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[daemon,nixl]'
	touch $@

nixl: $(VENV)/.nixl-deps

run: $(VENV)/.run-deps
	$(VENV)/bin/kvtierd --data-dir $(DATA_DIR)

# `make test`: every test but the slow ones (etcd clusters, network namespaces, NIXL timeouts waited
# out, crash states walked one by one), on TEST_WORKERS processes; `make test-all` (CI) runs those too
TEST_WORKERS ?= 2
test: $(VENV)/.test-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

test-slow: $(VENV)/.test-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m slow

test-all: test test-slow

# the store under abuse: the engine model with many sequences, then SOAK_CYCLES kill -9 cycles of a
# daemon under four writers with pins, soft pins, deletes (perf/soak.py; every count it prints must be 0)
SOAK_CYCLES ?= 100
soak: $(VENV)/.test-deps
	KVTIER_MODEL_EXAMPLES=2000 $(PY) -m pytest -q tests/test_engine_model.py
	$(PY) perf/soak.py --cycles $(SOAK_CYCLES) --out perf/results/soak.json

# a local cluster: etcd (apt-get install etcd-server) and 3 daemons on loopback, until Ctrl-C;
# CLUSTER_DIR holds their stores, CLUSTER_NODES how many daemons
CLUSTER_DIR ?= ./data/cluster
CLUSTER_NODES ?= 3
cluster: $(VENV)/.test-deps
	$(PY) tests/local_cluster.py --dir $(CLUSTER_DIR) --nodes $(CLUSTER_NODES)

# the dependency rule (common <- wire <- client, daemon; kernels <- client), import-linter's contracts
lint: $(VENV)/.test-deps
	$(VENV)/bin/lint-imports --no-logo

# the vLLM and SGLang connectors against the real frameworks, each in its own venv
test-engines:
	bash tests_engines/run.sh

clean-venv:
	rm -rf $(VENV)
