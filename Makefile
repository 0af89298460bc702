# Two commands for a new user; each sets itself up on a fresh machine:
#   make demo   - creates .venv (CPU torch 2.13.0) if needed, then trains the demo model on 4 CPU ranks
#   make test   - creates .venv if needed, then lint + the docs build + the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lightning-hydra-installed
TORCH_PIN := torch==2.13.0

.PHONY: setup demo test lint docs bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev,hf,fast,data,megatron]'
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m lightning_hydra demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The docs site (mkdocs.yml): --strict makes a broken link, a missing anchor or an unresolved API reference an error
# (not --quiet: it hides the warnings that --strict counts, and the build passes).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

test: lint docs
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m lightning_hydra.bench.schedule --full
	$(PY) -m lightning_hydra.bench.cp
	$(PY) -m lightning_hydra compare
	$(PY) -m lightning_hydra simulate --config recipes/sim-cpu-demo.yaml --validate runs/compare

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
