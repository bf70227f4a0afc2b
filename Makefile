# The two commands a reader needs (see README.md):
#   make book   set up .venv, dependencies and data, then render the book with Quarto
#   make test   set up the same way, then run every test (chapters included)
# Both are idempotent: a second run only re-installs when pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
QUARTO_MIN := 1.9

.PHONY: book test data setup clean gpu-results

# make gpu-results: every full-size result the book shows, as JSON with provenance in assets/results/.
# Meant for a GPU machine; PROFILE=cpu writes the same files from the small sizes.
# DRY_RUN=1 runs each run's training step at the gpu sizes on fake tensors (no GPU, nothing
# computed at full size) and records its peak memory beside the formula's, in
# <run>-gpu-dry-run.json files the chapters never read.
PROFILE ?= gpu
RESULTS_DIR ?= assets/results
DRY_RUN ?=

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[book,test]'
	@touch $(STAMP)

# Fetch and verify MNIST and Tiny Shakespeare (only checks them when BOOK_DATA_DIR is set).
data: $(STAMP)
	$(PY) -m torchbook.download

# The formatter and linter first (pyproject.toml, [tool.ruff]): a second of work.
test: data
	$(PY) -m ruff format --check --quiet .
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest $(PYTEST_ARGS)

book: data
	@command -v quarto >/dev/null 2>&1 || { \
	  echo "make book needs Quarto $(QUARTO_MIN) or newer on PATH, and it is not there."; \
	  echo "Install it from https://quarto.org/docs/get-started/ or with 'pip install quarto-cli' (needs internet)."; \
	  exit 1; }
	@version=$$(quarto --version); \
	if [ "$$(printf '%s\n%s\n' "$(QUARTO_MIN)" "$$version" | sort -V | head -n 1)" != "$(QUARTO_MIN)" ]; then \
	  echo "make book needs Quarto $(QUARTO_MIN) or newer (books render their PDF with Typst from 1.9 on); found $$version."; \
	  exit 1; fi
	QUARTO_PYTHON=$(abspath $(PY)) quarto render

gpu-results: data
	QUARTO_PROFILE=$(PROFILE) $(PY) examples/gpu_results.py --out $(RESULTS_DIR) $(if $(DRY_RUN),--dry-run)

clean:
	rm -rf _book .quarto .cache .pytest_cache
