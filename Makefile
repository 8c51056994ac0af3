# The README's two commands: `make demo` and `make test`. Each installs what is missing first.
# `make test-fast` runs the tests that start no processes (pytest -m "not multiprocess"): a few minutes.
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test test-fast bench clean

install:
	bash scripts/install.sh

demo: install
	$(PY) examples/run_demo.py

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q -m "not multiprocess" tests

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache
