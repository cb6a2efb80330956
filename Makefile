# The two commands of a fresh clone: `make demo` and `make test`. Each creates .venv when
# missing and installs shardwise (editable) with torch pinned to the offline CPU wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardwise-installed
LINT_PATHS := src tests examples bench

.PHONY: venv demo test lint typecheck pytest bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	rm -rf log_output
	$(VENV)/bin/shardwise run --worker_num 8 --local_worker_num 8 --log_dir log_output \
		--join True examples/collectives.py
	@echo "--- rank 0 (log_output/worker_0.log) ---"; cat log_output/worker_0.log
	@echo "--- every rank ---"; grep -h "all collectives OK" log_output/worker_*.log
	@echo "per-worker logs: log_output/worker_<rank>.log, launcher log: log_output/scheduler.log"

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# pytest exits 5 when it collected no test; that is a failure here, never a pass.
pytest: $(STAMP)
	@$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) log_output .mypy_cache .ruff_cache
