# hpcllm: `make test` sets everything up (idempotent) and runs lint and the tests.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test lint unit clean-venv

setup:
	bash scripts/setup.sh

lint: setup
	$(VENV)/bin/ruff check .

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# The tests that start no mpirun and no Slurm: seconds, for the edit-test loop.
unit: setup
	$(PY) -m pytest -m "not mpi and not slurm"

clean-venv:
	rm -rf $(VENV)
