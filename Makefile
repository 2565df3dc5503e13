# spotrl: `make up` runs the embedded default RL run, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch on our machines (a local wheel); on a CUDA machine pip takes the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-stamp

.PHONY: setup up test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

up: setup
	$(VENV)/bin/spotrl up

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff format --check services tests bench
	$(VENV)/bin/ruff check services tests bench

format: setup
	$(VENV)/bin/ruff format services tests bench
	$(VENV)/bin/ruff check --fix services tests bench

clean:
	rm -rf .spotrl .pytest_cache .ruff_cache
