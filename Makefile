# The README's two commands: `make demo` and `make test`. Each installs what is missing first.
# `make test-fast` runs the tests that start no processes (pytest -m "not multiprocess"): a few minutes.
# Both run `make lint` (ruff, configured in pyproject.toml) first.
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: install demo lint test test-fast bench clean

install:
	bash scripts/install.sh

demo: install
	$(PY) examples/run_demo.py

lint: install
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q tests

test-fast: lint
	$(PY) -m pytest -q -m "not multiprocess" tests

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache
