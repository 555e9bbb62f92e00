# Two commands on a fresh machine: `make test` and `make bench`.
# The venv sees system site-packages so an already-installed torch (a CUDA build on a
# GPU box, or the CPU wheel) is kept; only when none imports is torch==2.13.0 installed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.omnilink-installed
LOCK := $(VENV).lock

.PHONY: setup test bench docs clean

setup: $(STAMP)

# Two targets started at once in one clone (`make test & make bench`) must not install
# into the venv together: the install runs under an flock on $(LOCK), in a sub-make that
# looks at the stamp again once it holds the lock, so the second one finds it done.
ifdef OMNILINK_VENV_LOCKED
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	# A venv made before the distribution was renamed holds the old `omnilink` one.
	$(PY) -m pip uninstall -q -y omnilink 2>/dev/null || true
	$(PY) -m pip install -q -e ".[test,plot,docs]"
	# vLLM-Omni's connector modules, for the integration tests: they load them without vLLM
	# (tests/integration/_vllm_omni_stubs.py says how).
	$(PY) -m pip install -q --no-deps "vllm-omni==0.30.0"
	# NIXL for the nixl backend's tests (the `[nixl]` extra): the meta package and one build
	# of it, without dependencies, so that pip never swaps the installed torch for another
	# build (nixl-cu12 declares torch). Without a GPU the meta package takes whichever
	# build is installed.
	$(PY) -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
	touch $(STAMP)
else
$(STAMP): pyproject.toml
	@if command -v flock >/dev/null 2>&1; then \
		flock $(LOCK) $(MAKE) --no-print-directory OMNILINK_VENV_LOCKED=1 $(STAMP); \
	else \
		$(MAKE) --no-print-directory OMNILINK_VENV_LOCKED=1 $(STAMP); \
	fi
endif

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) -m omnilink bench --json benchmarks/results/latest.jsonl --plot benchmarks/results/latest.png

# The docs site, into build/site (`$(VENV)/bin/mkdocs serve` to browse while editing).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) $(LOCK) build dist site *.egg-info
