# hpcllm: `make test` sets everything up (idempotent) and runs lint and the tests.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test lint unit demo clean-venv gpu-report docs-examples

setup:
	bash scripts/setup.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# --durations: the slowest tests of every run, to keep the suite's time in view.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest --durations=25

# The edit-test loop: the tests that start no mpirun and no Slurm and take under a second
# each (those marked slow take more; make test runs them all).
unit: setup
	$(PY) -m pytest -m "not mpi and not slurm and not slow"

clean-venv:
	rm -rf $(VENV)

# The main job: prepare the built-in corpus (once), train the tiny GPT on 2 MPI ranks, sample.
# DEMO_ARGS adds options to the training (--set train.steps=20, say).
DEMO_NP ?= 2
DEMO_RUN ?= runs/tiny-cpu
DEMO_ARGS ?=
demo: setup
	@test -f data/stdlib/manifest.json || $(VENV)/bin/hpcllm prepare --corpus python-stdlib --out data/stdlib
	NP=$(DEMO_NP) jobs/mpirun.sh train --config jobs/configs/tiny-cpu.yaml --set run.dir=$(DEMO_RUN) --set run.resume=none --set run.overwrite=true $(DEMO_ARGS)
	@echo "--- a sample from $(DEMO_RUN):"
	@$(VENV)/bin/hpcllm generate --checkpoint $(DEMO_RUN) --prompt "def " --tokens 120

# Measure this GPU node and hpcllm on it (about 20 minutes on one H100): installs nothing, so
# it runs where hpcllm is installed (the venv if there is one, else python3); a machine
# without a GPU is told so in one line. REPORT_ARGS adds options (--quick, --parts ...).
REPORT_PY := $(if $(wildcard $(PY)),$(PY),python3)
REPORT_DIR ?= gpu-report
gpu-report:
	$(REPORT_PY) -m hpcllm bench report --out $(REPORT_DIR) $(REPORT_ARGS)

# Every CPU example of the README and docs/ as written, in order, in a fresh copy of the
# working tree (tests/docs_examples.py; make test walks them in its quick mode).
docs-examples: setup
	$(PY) tests/docs_examples.py
