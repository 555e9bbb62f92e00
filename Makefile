# Two commands on a fresh machine: `make test` and `make bench`.
# The venv sees system site-packages so an already-installed torch (a CUDA build on a
# GPU box, or the CPU wheel) is kept; only when none imports is torch==2.13.0 installed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.omnilink-installed

.PHONY: setup test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,plot]"
	# vLLM-Omni's connector modules, for the integration tests (no vLLM: see REFERENCE).
	$(PY) -m pip install -q --no-deps "vllm-omni==0.30.0"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) -m omnilink bench --json benchmarks/results/latest.jsonl --plot benchmarks/results/latest.png

clean:
	rm -rf $(VENV) build *.egg-info
