# Every target sets itself up: a local virtualenv with the CPU build of torch installed first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
RAY_STAMP := $(VENV)/.installed-ray

.PHONY: demo test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(RAY_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,ray]'
	touch $(RAY_STAMP)

demo: $(STAMP)
	$(BIN)/prisme demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(RAY_STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check prisme tests benchmarks

bench: $(STAMP)
	bash benchmarks/run_cpu.sh

clean:
	rm -rf $(VENV) build *.egg-info runs .pytest_cache
