# The README's two commands: `make demo` and `make test`. Each installs what is missing first.
# `make test` runs every test: those marked multiprocess (in streams, tests/conftest.py), and beside them the others.
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

# Four pytest processes: the tests that start no processes, and the multi-process streams "torch" and
# "rest" (tests/conftest.py), side by side (their jobs wait on start-ups and time limits much of the
# time, leaving the cores to the others); then the "links" stream alone, whose shaped links are timed.
# The "rest" stream reports as it runs, the others' reports follow; all must pass.
test: lint
	@logs=$$(mktemp -d); \
	$(PY) -m pytest -q -m "not multiprocess" tests >$$logs/fast 2>&1 & fast=$$!; \
	$(PY) -m pytest -q -m multiprocess --stream torch tests >$$logs/torch 2>&1 & torch=$$!; \
	echo "--- rest:"; $(PY) -m pytest -q -m multiprocess --stream rest tests; rest=$$?; \
	wait $$torch; torch=$$?; wait $$fast; fast=$$?; \
	$(PY) -m pytest -q -m multiprocess --stream links tests >$$logs/links 2>&1; links=$$?; \
	for part in torch fast links; do echo "--- $$part:"; cat $$logs/$$part; done; rm -rf $$logs; \
	test $$fast -eq 0 && test $$torch -eq 0 && test $$rest -eq 0 && test $$links -eq 0

test-fast: lint
	$(PY) -m pytest -q -m "not multiprocess" tests

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache
