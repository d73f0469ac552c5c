# jaxps: the front door. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TF_VENV := .venv-tf
TF_STAMP := $(TF_VENV)/.installed
export PYTHONPATH := $(CURDIR)/runtime:$(CURDIR)/operator
# JAX on this machine is CPU only; keep its start-up quiet and its threads bounded.
export JAX_PLATFORMS ?= cpu
# mypy's cache outside the repo, as the builds' (hack/control-plane.sh): a fresh clone's
# `make verify` reads it again (mypy checks each file's hash) rather than starting cold
export MYPY_CACHE_DIR ?= $(or $(JAXPS_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/jaxps)/mypy

.PHONY: help install run test build-node build-images build-kueue tier-cluster tier-e2e test-unit test-process test-cluster test-e2e lint format verify protos \
	docs bench bench-tf clean control-plane node images kueue kubeflow cluster-up cluster-down
# Debian packages of the one-node cluster and the image builder (hack/node.py, hack/image.py)
NODE_PACKAGES := containerd runc containernetworking-plugins iptables conntrack mmdebstrap openssl gcc
TIMED := JAXPS_TIMES=$(CURDIR)/.work/times hack/timed.sh
# the docs site (mkdocs.yml; into .work/site); Material's banner about MkDocs 2 is not ours
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
# every tier of `make test` prints its 15 slowest tests: where the next minute is to be won
TIER_OPTS := -q --durations=15
# pytest-xdist workers of each tier: the unit tests on both cores; the process tier's jobs
# side by side (each worker its own ports); the cluster tier's on a control plane and an
# operator per worker (they mostly wait on the API server); the e2e tier's on one node the
# controller brings up (tests/e2e/conftest.py); 0 runs a tier in one process
UNIT_WORKERS ?= 2
PROCESS_WORKERS ?= 3
CLUSTER_WORKERS ?= 3
E2E_WORKERS ?= 3

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@command -v $(PYTHON_SYSTEM) >/dev/null || { echo "need $(PYTHON_SYSTEM) (>= 3.11)"; exit 1; }
	@$(PYTHON_SYSTEM) -c 'import venv, ensurepip' 2>/dev/null || hack/apt-install.sh python3-venv
	$(PYTHON_SYSTEM) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[runtime,operator,dev]'
	@touch $@

install: $(STAMP) ## Install jaxps and its tools into .venv (Python packages; apt-get only if venv is missing)

run: install ## Run examples/mnist.yaml on this machine (jaxps local): 2 ps + 2 workers, sync
	$(VENV)/bin/jaxps local examples/mnist.yaml

test: install ## make verify, the builds, then every tier (unit, process, cluster, e2e), each timed
	@mkdir -p .work && rm -f .work/times
	@$(TIMED) "verify" $(MAKE) --no-print-directory verify
	@$(TIMED) "build: Debian packages" hack/apt-install.sh $(NODE_PACKAGES)
	@$(TIMED) "builds, side by side" $(MAKE) --no-print-directory -j3 --output-sync=line \
	  build-node build-images build-kueue
	@$(TIMED) "tier: unit" $(PY) -m pytest $(TIER_OPTS) -n $(UNIT_WORKERS) tests/unit
	@$(TIMED) "tier: process" $(PY) -m pytest $(TIER_OPTS) -n $(PROCESS_WORKERS) \
	  --dist loadgroup tests/process
	@$(TIMED) "tiers: cluster and e2e, side by side" $(MAKE) --no-print-directory -j2 \
	  --output-sync=line tier-cluster tier-e2e
	@echo "--- make test: time per phase ---" && cat .work/times

# the cluster tier (a control plane and operator per worker on 127.0.0.1, mostly waiting on
# them) beside the e2e tier (the node, whose pods leave CPU idle while they start): they share
# nothing, and each is timed on its own
tier-cluster:
	@$(TIMED) "tier: cluster" $(PY) -m pytest $(TIER_OPTS) -n $(CLUSTER_WORKERS) tests/cluster
tier-e2e:
	@$(TIMED) "tier: e2e (node up, tests, down)" $(PY) -m pytest $(TIER_OPTS) -n $(E2E_WORKERS) \
	  --dist loadgroup tests/e2e

# each build of `make test` timed on its own while they run side by side (none depends on
# another: the Go builds share the module and build caches, which Go locks; the images need
# only Python and the Debian packages, installed before)
build-node build-images build-kueue: build-%:
	@$(TIMED) "build: $*" $(MAKE) --no-print-directory $*

test-unit: install ## Run the unit tests only
	$(PY) -m pytest -q -n $(UNIT_WORKERS) tests/unit

test-process: install ## Run the process tests only (real ps processes on 127.0.0.1)
	$(PY) -m pytest -q -n $(PROCESS_WORKERS) --dist loadgroup tests/process

test-cluster: install control-plane ## Run the cluster tests only (a real control plane and the operator)
	$(PY) -m pytest -q -n $(CLUSTER_WORKERS) tests/cluster

test-e2e: install node images kueue ## Run the e2e tests only (a real one-node cluster with Kueue: pods run the runtime)
	$(PY) -m pytest -q -n $(E2E_WORKERS) --dist loadgroup tests/e2e

lint: install ## ruff lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install ## Apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: install ## Regenerate the Python stubs from protos/
	PYTHON=$(CURDIR)/$(PY) hack/gen-protos.sh

verify: lint ## Lint, types, import contracts (the runtime's rooms), class sizes and the drift checks (stubs, CRD copies, spec.training, optimizer table, generated docs), the docs site built --strict
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) hack/structure.py --check
	$(PY) -m jaxps_runtime.config --check
	$(PY) hack/training_schema.py
	$(PY) hack/docs_reference.py --check
	$(MKDOCS) build --strict
	@echo "docs site builds (mkdocs --strict)"
	@for copy in operator/jaxps_operator/crd/trainingjob.yaml charts/jaxps/crds/trainingjob.yaml; do \
	  diff -u crds/trainingjob.yaml $$copy >/dev/null || { echo "$$copy drifted from crds/: copy it"; exit 1; }; \
	done; echo "packaged and chart CRDs match crds/"
	@tmp=$$(mktemp -d) && PYTHON=$(CURDIR)/$(PY) hack/gen-protos.sh $$tmp && \
	  diff -r -x __pycache__ $$tmp/jaxps runtime/jaxps && rm -rf $$tmp && \
	  echo "generated stubs match protos/" || { echo "stubs drifted: run 'make protos' and commit"; exit 1; }

docs: install ## Write the generated reference pages (docs/reference/) and build the docs site into .work/site
	$(PY) hack/docs_reference.py
	$(MKDOCS) build --strict

$(TF_STAMP): bench/tf/requirements.txt
	@$(PYTHON_SYSTEM) -c 'import venv, ensurepip' 2>/dev/null || hack/apt-install.sh python3-venv
	$(PYTHON_SYSTEM) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TF_VENV)/bin/python -m pip install --quiet -r bench/tf/requirements.txt
	@touch $@

bench-tf: install $(TF_STAMP) ## jaxps vs TensorFlow's own ps runtime, same work (JSON lines; TF in .venv-tf)
	$(PY) bench/vs_tensorflow.py --tf-python $(TF_VENV)/bin/python

control-plane: ## Build kube-apiserver, controller-manager, scheduler, kubectl, etcd and helm once (cached outside the repo)
	hack/control-plane.sh build

node: ## Build kubelet, kube-proxy and CoreDNS too (cached) and install the node's Debian packages
	hack/apt-install.sh $(NODE_PACKAGES)
	hack/control-plane.sh node

images: install ## Build the runtime and operator images without a registry (cached by content)
	hack/apt-install.sh $(NODE_PACKAGES)
	$(PYTHON_SYSTEM) hack/image.py build runtime
	$(PYTHON_SYSTEM) hack/image.py build operator

kueue: ## Build Kueue v0.17.0's manager and chart from its Go module once (cached outside the repo)
	hack/control-plane.sh kueue

kubeflow: ## Build Kubeflow's training-operator v1.9.3 from its Go module once: bench/operator.py's baseline
	hack/control-plane.sh kubeflow

cluster-up: node images kueue ## Start a one-node cluster (root) with Kueue and the operator installed; writes .cluster/kubeconfig
	$(PYTHON_SYSTEM) hack/node.py up --dir .cluster --with-kueue --with-jaxps
	@echo "export KUBECONFIG=$(CURDIR)/.cluster/kubeconfig PATH=$$(hack/control-plane.sh bin):\$$PATH"

cluster-down: ## Stop everything cluster-up started; remove its pods, mounts, interfaces and state
	$(PYTHON_SYSTEM) hack/node.py down --dir .cluster

bench: install control-plane node images kueue kubeflow $(TF_STAMP) ## Run every benchmark, TensorFlow's and Kubeflow's baselines included (JSON lines on stdout; the node's needs root)
	$(PY) bench/suite.py --tf-python $(TF_VENV)/bin/python   # every bench; the run kept in .bench/results.jsonl, its table on stderr

clean: ## Remove the virtualenv and caches
	rm -rf $(VENV) $(TF_VENV) .mypy_cache .ruff_cache .pytest_cache
