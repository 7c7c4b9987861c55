# Set-up is part of every target: a fresh clone needs only Python 3.11 and these targets.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Stages `make repro` runs at a time (pipeline/repro.py): one per core, as every training
# computes with one core (train.placement.cpus_per_worker); 1: a plain `dvc repro`. The
# cores this process may use (nproc would give $OMP_NUM_THREADS instead when it is set).
JOBS   ?= $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
# DVC runs each stage's `python -m stages.<name>` with the first `python` on PATH: the
# targets below put the venv first, so they work from a shell where it is not activated.
IN_VENV := PATH="$(abspath $(BIN)):$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: setup repro push-results pull-results compare test test-fast test-order lint bench

# torch first, at the version pyproject.toml pins (2.13.0), alone, before a looser resolve
# of the rest. Which build arrives is the index's choice: plain PyPI on Linux x86-64 gives
# the CUDA one (several GB of nvidia-* wheels); a machine whose pip config names a local
# CPU wheel (as this one's) gets 2.13.0+cpu. For the CPU build from the internet, first
#   python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# then `make setup`, which keeps it (the installed torch meets the pin).
# An existing venv is kept (a change to pyproject.toml re-installs into it): `venv` run over
# a venv made by another python3 rewrites its pyvenv.cfg and breaks it. `rm -r .venv` starts over.
# constraints.txt: the versions the tests ran with, shared with the images (infra/).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "hiertx needs Python >= 3.11"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# params.yaml is checked first: a mistake DVC would report in its own words (a run key in
# both train.runs and tune.runs: "Use dvc remove", a key written twice) gets the project's
# explanation, and a file DVC's parser would take minutes over (over 1 MB, aliases adding
# more than 100,000 values: pipeline/config/params_file.py) stops make in seconds.
repro: setup  ## the main job: dvc repro on the embedded chitchat corpus, a stage per core (JOBS=N)
	$(IN_VENV) $(BIN)/python -m stages.check --out .dvc/tmp/check
ifeq ($(JOBS),1)
	$(IN_VENV) $(BIN)/dvc repro
else
	$(IN_VENV) $(BIN)/python -m pipeline.repro --jobs $(JOBS)
endif

# A run's results in a bucket you own (pipeline/results.py): on the cluster after make repro,
# in a clone at the run's commit on your machine. REMOTE: s3://BUCKET/PREFIX, gs://... or a
# folder; unset: $$HIERTX_RESULTS_URL.
push-results: setup  ## dvc push to a DVC remote at REMOTE/dvc, dvc.lock, metrics, plots, report, MLflow fallback store to REMOTE
	$(IN_VENV) $(BIN)/python -m pipeline results push $(REMOTE)

pull-results: setup  ## the results at REMOTE into this clone (at the run's commit): files, dvc pull, MLflow runs replayed
	$(IN_VENV) $(BIN)/python -m pipeline results pull $(REMOTE)

compare: setup  ## the runs' key metrics side by side, a table per task (REV=main: changes since main)
	$(BIN)/python -m pipeline compare $(if $(REV),--rev $(REV))

# The tests run on pytest-xdist workers, one more than the cores (TEST_WORKERS=0: all in one
# process), each with one torch/OpenMP thread; `--dist loadgroup` keeps the tests of one
# @pytest.mark.xdist_group on one worker, one after another (tests/timing.py: which start first).
# One more than the cores (counted as JOBS counts them): the multi-node tests' worker waits on
# Ray much of its time (2 cores: pytest 24.1 min with 2 workers; 20.4 and 21.5 min with 3, the
# cores 95% busy).
TEST_WORKERS ?= $(shell echo $$(( $$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2) + 1 )))
PYTEST := $(IN_VENV) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
	--dist loadgroup --no-loadscope-reorder

# Every test's time and each file's total are printed at the end; a test over 60 s of the
# reference machine (tests/timing.py scales it to this one's speed) that tests/timing.py does
# not declare fails the run. On CI ($$CI set) a skip is a failure.
test: setup  ## the layers' import contracts, then the whole test suite (slow tests included)
	$(IN_VENV) PYTHONPATH=. $(BIN)/lint-imports
	$(PYTEST) -rs --time-report --time-limit 60

test-fast: setup  ## the inner loop: the tests not marked slow, in parallel (CI runs `make test`)
	$(PYTEST) -m "not slow"

# Does any test depend on the order it runs in? `python -m tests.order` runs the tests reversed
# (pytest-reverse), shuffled with each seed of ORDER_SEEDS (pytest-random-order: the modules'
# order and the tests' within each), then each test module alone in a fresh process,
# TEST_WORKERS at a time, and lists what failed in which order. The not-slow tests (21 min
# on 2 cores with TEST_WORKERS=2); SLOW=1: all of them (each module alone: 29 min). ORDERS:
# the orders to run (ORDERS=alone: only each module alone). Both plugins act only when
# asked: `make test` and `make test-fast` run in pytest's order. CI does not run it.
ORDER_SEEDS ?= 1 2 3
ORDERS      ?= reversed shuffled alone
test-order: setup  ## the order-dependence search: reversed, 3 seeded shuffles, each module alone
	$(IN_VENV) OMP_NUM_THREADS=1 $(BIN)/python -m tests.order --workers $(TEST_WORKERS) \
		--orders $(ORDERS) --seeds $(ORDER_SEEDS) $(if $(filter 1,$(SLOW)),--slow)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup  ## training throughput against BART and torch.nn.Transformer (bench/RESULTS.md)
	$(IN_VENV) $(BIN)/python -m bench.bench_train
