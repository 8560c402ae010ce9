# Kaizen developer commands. `make test` is what CI runs (.ci/run); `make run` starts a serving gateway.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test lint typecheck bench-overhead clean

# The application environment: every package pinned in requirements/app.txt, installed without resolution
# (fast, reproducible; torch comes from the machine's CPU wheel), then Kaizen itself in editable mode.
$(VENV)/.installed: requirements/app.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements/app.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

# pytest exits 5 when a selection collects nothing; that is not a failure of the suite.
test: lint typecheck
	$(BIN)/python -m pytest -p no:cacheprovider; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench-overhead: install
	$(BIN)/python -m tests.bench.bench_overhead --out tests/bench/results/overhead.json

clean:
	rm -rf $(VENV) .venv-vllm .mypy_cache .ruff_cache
