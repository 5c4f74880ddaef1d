# Every target installs what it needs into .venv by itself.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU wheel, pinned: an unpinned torch would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test test-slow test-catalogue check-wheel demo bench lint mutants mutate verify verify-long gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]" "$(TORCH)"
	touch $(STAMP)

# The suite but the fault catalogue and the slow tests, on two test processes (pytest-xdist), a test file each
# at a time: the multi-rank tests leave a third of two cores idle while ranks wait on each other, and a second
# process fills it. Two, not one per core: each process keeps its own rank pools (up to 10 ranks).
# make test-slow runs the tests marked slow (over about 5 s each: whole verify searches, the examples under
# torchrun, memory plans of real configs), spread test by test; make test-catalogue runs the catalogue (in
# parts over both processes). CI runs all three. A plain `pytest` runs everything in one process.
XDIST := -n 2
test: install
	$(PY) -m pytest -q $(XDIST) --dist loadfile -m "not catalogue and not slow"

test-slow: install
	$(PY) -m pytest -q $(XDIST) --dist load -m "slow and not catalogue"

test-catalogue: install
	$(PY) -m pytest -q $(XDIST) --dist loadgroup -m catalogue tests/test_mutants.py

# The packaging check: build the sdist and wheel, install the wheel into a new virtual environment and
# use it from outside the checkout (see .ci/check_wheel.py; about two minutes). CI runs it after make test.
check-wheel: install
	$(PY) .ci/check_wheel.py

demo: install
	$(PY) -m paramfsm.testing.demo --out demo-out

bench: install
	$(PY) benchmarks/fsm_dispatch.py
	$(PY) benchmarks/step_overhead.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/optimizer_mapping.py
	$(PY) benchmarks/gather_scatter.py --device cpu
	$(PY) benchmarks/scale_sim.py --estimate

lint: install
	$(PY) -m compileall -q paramfsm tests benchmarks
	$(PY) .ci/module_size.py paramfsm  # 400 lines of code a module; notes and docstrings do not count
	@if grep -rnE '\.state\s*=[^=]' paramfsm --include='*.py' | grep -v '^paramfsm/core/fsm.py'; then \
	  echo "a parameter state is assigned outside paramfsm/core/fsm.py"; exit 1; fi
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py tests/test_schedule_components.py

mutants: install
	$(PY) -m paramfsm.testing.mutants

# Mutation testing (not part of make test): mutmut mutates the modules listed under [tool.mutmut]
# in pyproject.toml and runs their in-process tests against each mutant; results stay in mutants/.
# One thread: mutmut forks the test process for every mutant, and a fork of a process whose OpenMP
# pool has run (a LayerNorm) deadlocks in its next parallel op. One child at a time on this box.
MUTMUT := mutmut==3.8.1
mutate: install
	$(PY) -m pip install --quiet "$(MUTMUT)"
	rm -rf mutants
	OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 1
	@$(PY) -m paramfsm.testing.mutation_score

verify: install
	$(PY) -m paramfsm verify paramfsm.testing.subjects:tiny_transformer --examples 50
	$(PY) -m paramfsm verify paramfsm.testing.subjects:sized_lm --examples 30
	$(PY) -m paramfsm verify paramfsm.testing.subjects:branchy_lm --world-size 3 --examples 20
	$(PY) -m paramfsm verify paramfsm.testing.subjects:tiny_transformer_meta --world-size 3 --examples 10
	$(PY) -m paramfsm verify paramfsm.testing.subjects:gan_pair --examples 20
	$(PY) -m paramfsm verify paramfsm.testing.subjects:structured_outputs --examples 10
	$(PY) -m paramfsm verify paramfsm.testing.subjects:view_outputs --examples 10
	$(PY) -m paramfsm verify paramfsm.testing.subjects:frozen_norm_mlp --examples 10

# Longer than CI's fixed budget, with a new seed each run (printed first, so a failure replays with
# --seed): 200 programs per subject. Run it before a change to the engine lands.
VERIFY_SEED ?= $(shell date +%s)
verify-long: install
	@echo "verify-long seed $(VERIFY_SEED)"
	$(PY) -m paramfsm verify paramfsm.testing.subjects:tiny_transformer --examples 200 --seed $(VERIFY_SEED)
	$(PY) -m paramfsm verify paramfsm.testing.subjects:sized_lm --examples 200 --seed $(VERIFY_SEED)
	$(PY) -m paramfsm verify paramfsm.testing.subjects:branchy_lm --world-size 3 --examples 200 --seed $(VERIFY_SEED)

# The GPU check needs a Python whose torch is a CUDA build (the .venv above holds the CPU wheel);
# it installs the cuda extra into that Python when CuPy is missing. Exit 2: no GPU here.
GPU_PYTHON ?= python3
gpu-check:
	@$(GPU_PYTHON) -c "import torch" 2>/dev/null || { \
	  echo "gpu-check: $(GPU_PYTHON) has no torch; run make gpu-check GPU_PYTHON=<a Python whose torch has CUDA>"; \
	  exit 2; }
	@$(GPU_PYTHON) -m paramfsm.testing.gpu_check

clean:
	rm -rf $(VENV) demo-out .pytest_cache .hypothesis mutants build dist *.egg-info
