# gpubroker: every set-up step lives here. `make demo` and `make test` work on a
# fresh machine with Python 3.10+, Node.js/npm and the package registries.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROXY := node_modules/.bin/configurable-http-proxy
PYTEST_ARGS ?= --durations=25

.PHONY: help setup postgres docker-engine chromium slurm demo demo-slurm test lint format typecheck unit docs bench clean

help:
	@echo "make demo   - set up, then run JupyterHub + broker on simulated GPUs (http://127.0.0.1:8000)"
	@echo "make demo-slurm - the same on a real two-node Slurm cluster started here (root)"
	@echo "make test   - set up, then lint, type-check, build docs and run every test"
	@echo "make bench  - set up, then run the benchmarks (writes bench-results.json)"
	@echo "make docs   - build the documentation into docs/_build/html"

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -e '.[test,docs,sim,report,docker]'
	touch $@

$(PROXY): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The Docker engine, for the docker job runner's tests (Debian's package;
# installed only where it is missing; the tests start their own dockerd)
docker-engine:
	@test -x /usr/sbin/dockerd || command -v dockerd >/dev/null || \
	  { echo "installing the Docker engine (apt-get install docker.io)"; \
	    apt-get update -q >/dev/null; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null; }

# PostgreSQL server binaries, for the store tests on a real PostgreSQL
# (Debian's package; installed only where they are missing)
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || \
	  { echo "installing PostgreSQL (apt-get install postgresql)"; \
	    apt-get update -q >/dev/null; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; }

# Chromium, for the panel's browser tests (Debian's package; installed only
# where it is missing; Playwright drives it, and never downloads a browser)
chromium:
	@command -v chromium >/dev/null || \
	  { echo "installing Chromium (apt-get install chromium)"; \
	    apt-get update -q >/dev/null; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }

# Slurm and munge, for the Slurm engine's tests on a real two-node cluster
# (Debian's packages; installed only where missing; the tests start their
# own munged, slurmctld and two slurmd daemons, see tests/slurmutil.py)
slurm:
	@test -x /usr/sbin/slurmctld && test -x /usr/sbin/slurmd && test -x /usr/sbin/munged || \
	  { echo "installing Slurm (apt-get install slurm-wlm munge)"; \
	    apt-get update -q >/dev/null; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }

setup: $(BIN)/.installed $(PROXY)

demo: setup
	@echo "JupyterHub with gpubroker on simulated GPUs: open http://127.0.0.1:$${GPUBROKER_DEMO_PORT:-8000}"
	@echo "and log in as any user with the password the hub prints below (user 'admin', a"
	@echo "broker admin, with the admin password printed beside it);"
	@echo "pick a GPU profile on the spawn page. Ctrl-C stops it."
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/jupyterhub -f jupyterhub_config/demo_config.py

demo-slurm: setup slurm
	@echo "JupyterHub with gpubroker on a two-node Slurm cluster (n1, n2: 4 GPUs each):"
	@echo "open http://127.0.0.1:$${GPUBROKER_DEMO_PORT:-8000}, log in as any user with the"
	@echo "password the hub prints; servers"
	@echo "and jobs run as Slurm jobs (squeue shows them). Ctrl-C stops hub and cluster."
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m gpubroker.engines.slurm_testbed \
	  $(BIN)/jupyterhub -f jupyterhub_config/demo_config.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: setup
	$(BIN)/mypy

docs: setup
	rm -rf docs/_build
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

test: lint typecheck docs postgres docker-engine chromium slurm
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup chromium slurm
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) node_modules docs/_build demo-run bench-results.json
