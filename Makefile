# The two commands a reader needs (see README.md):
#   make book   set up .venv, dependencies and data, then render the book with Quarto
#   make test   set up the same way, then run every test (chapters included)
# Both are idempotent: a second run only re-installs when pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: book test data setup clean gpu-results

# make gpu-results: every full-size result the book shows, as JSON with provenance in assets/results/.
# Meant for a GPU machine; PROFILE=cpu writes the same files from the small sizes.
# DRY_RUN=1 calls the same run functions at the gpu sizes on fake tensors (no GPU, nothing
# computed at full size; counts cut to a few steps) and records each run's peak memory
# beside the formula's, in <run>-gpu-dry-run.json files the chapters never read.
PROFILE ?= gpu
RESULTS_DIR ?= assets/results
DRY_RUN ?=
# Tests run in parallel, one process per core, torch on one thread in each.
PYTEST_WORKERS ?= auto

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[book,test]'
	@touch $(STAMP)

# Fetch and verify MNIST and Tiny Shakespeare (only checks them when BOOK_DATA_DIR is set).
data: $(STAMP)
	$(PY) -m torchbook.book.download

# The formatter and linter first (pyproject.toml, [tool.ruff]): a second of work.
test: data
	$(PY) -m ruff format --check --quiet .
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The Quarto on PATH if it is 1.9 or newer; else tools/find_quarto.py installs the pinned
# quarto-cli into .venv (its build downloads Quarto, so that needs internet).
book: data
	@quarto=$$($(PY) tools/find_quarto.py) || exit 1; \
	echo "QUARTO_PYTHON=$(abspath $(PY)) $$quarto render"; \
	QUARTO_PYTHON=$(abspath $(PY)) "$$quarto" render

gpu-results: data
	QUARTO_PROFILE=$(PROFILE) $(PY) examples/gpu_results.py --out $(RESULTS_DIR) $(if $(DRY_RUN),--dry-run)

clean:
	rm -rf _book .quarto .cache .pytest_cache
