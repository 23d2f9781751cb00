# The two commands of the README: `make demo` and `make test`. Both set up what they need.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all e2e lint typecheck crds bench prometheus controlplane clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 (Debian: apt-get install python3.11 python3.11-venv)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The real Prometheus server (Debian package) backs the integration and e2e tests and the demo.
prometheus:
	@bash scripts/ensure-prometheus.sh

# The real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler) built from the Go module in controlplane/ once, then cached under
# ~/.cache/vllm-autotuner/controlplane/ (about 9 minutes on 2 cores the first time; seconds
# after). KUBEBUILDER_ASSETS, if set, provides the binaries it holds.
controlplane: $(STAMP)
	@$(BIN)/vllm-localcluster controlplane path >/dev/null 2>&1 || { VENV=$(VENV) bash scripts/ensure-go.sh && PATH="$(abspath $(BIN)):$$PATH" $(BIN)/vllm-localcluster controlplane ensure; }

lint: $(STAMP)
	$(BIN)/ruff check operator sim localcluster tests bench e2e scripts
	$(BIN)/ruff format --check operator sim localcluster tests bench e2e scripts
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# Two workers (CI has two cores): each runs its own control plane and Prometheus servers;
# 7 min instead of 10 on the 2-core development machine.
test: $(STAMP) prometheus controlplane lint typecheck
	$(BIN)/pytest -q -n 2

test-all: $(STAMP) prometheus controlplane
	$(BIN)/pytest -q -m ''

# The closed loop on the one-machine cluster (several minutes per scenario).
e2e: $(STAMP) prometheus controlplane
	$(BIN)/pytest -q e2e -m e2e

bench: $(STAMP)
	$(BIN)/python -m bench.tuning bench/scenarios/*.yaml --out bench/results/tuning

crds: $(STAMP)
	$(BIN)/vllm-autotuner crds --out crds
	$(BIN)/python scripts/sync-chart-crds.py

demo: $(STAMP) prometheus controlplane
	$(BIN)/vllm-localcluster demo

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
