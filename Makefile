# kvxfer: `make test` runs every test; `make serve` runs the daemon on an embedded default.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test serve bench proto devcheck clean

# (Re)install when the project's metadata changes; torch is pinned to the local CPU build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/kvxfer serve $(SERVE_ARGS)

bench: $(STAMP)
	$(VENV)/bin/kvxfer bench $(BENCH_ARGS)

# On a GPU machine: everything only a GPU can show, results in devcheck-out/devcheck.json.
# Needs no install and no gRPC (the lent machines have neither): it runs from the checkout.
devcheck:
	PYTHONPATH=. $(PYTHON) -m kvxfer.devcheck --out devcheck-out $(DEVCHECK_ARGS)

# Regenerate kvxfer/v1 from protos/ (committed; tests/unit/test_proto_current.py checks it).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/kvxfer/v1/kvxfer.proto

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
