# The README's two commands: `make demo` and `make test`. Each installs what is missing first.
# `make test` runs every test: those marked multiprocess, and beside them the others.
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

# The tests that start no processes (one core) run beside those that do, which leave the second core
# idle much of the time; their report follows. Both must pass.
test: lint
	@log=$$(mktemp); $(PY) -m pytest -q -m "not multiprocess" tests >$$log 2>&1 & single=$$!; \
	$(PY) -m pytest -q -m multiprocess tests; multi=$$?; \
	wait $$single; status=$$?; echo "--- the tests that start no processes:"; cat $$log; rm -f $$log; \
	test $$multi -eq 0 && test $$status -eq 0

test-fast: lint
	$(PY) -m pytest -q -m "not multiprocess" tests

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache
