# Two commands do all setup on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The tested CPU build of torch; pyproject.toml declares only the range torch>=2.11.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint types unit docs coverage clean

# The demo needs evendp and torch only ($(VENV)/.base); the test targets add the dev extras
# (transformers, accelerate, lightning, deepspeed, trl, the linters, mkdocs). Both install with
# torch pinned as a constraint, so no dependency can pull in another, multi-GB CUDA build.
$(VENV)/.base: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	echo "$(TORCH_PIN)" > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e .
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[dev]"
	touch $@

# A demo is a fresh run each time: --overwrite replaces the previous demo's checkpoint. Its
# learning rate is the demo GPT's own, 3e-3 (evendp train's default is 1e-3, TrainConfig's).
demo: $(VENV)/.base
	$(VENV)/bin/evendp train --overwrite --lr 3e-3

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

types: $(VENV)/.installed
	$(VENV)/bin/mypy

# DeepSpeed on CPU builds a comm op on first use; the suite builds it once, here, into a folder
# of its own (a build killed midway in ~/.cache leaves a lock that makes later builds wait).
# tests/conftest.py points TORCH_EXTENSIONS_DIR at the same folder for a plain `pytest`.
EXTENSIONS := build/torch_extensions
$(EXTENSIONS)/.built: $(VENV)/.installed
	TORCH_EXTENSIONS_DIR=$(abspath $(EXTENSIONS)) $(PY) -m tests._extensions
	touch $@

# The suite starts ~150 Python processes that import evendp (ranks, launchers, checks): its
# bytecode is compiled once, here, even where PYTHONDONTWRITEBYTECODE=1 (CI) would have each
# process compile it again (~0.3 s of CPU each). compileall writes whatever that variable says.
BYTECODE := $(PY) -m compileall -q src tests benchmarks examples

# Two pytest workers on the machine's 2 cores: a module's tests stay on one worker (conftest.py);
# PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= 2
# Extra pytest options for a look at the suite, e.g. PYTEST_ARGS=--durations=25.
PYTEST_ARGS ?=
unit: $(VENV)/.installed $(EXTENSIONS)/.built
	$(BYTECODE)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The suite with line coverage of src/ (pyproject.toml's [tool.coverage.run]).
coverage: $(VENV)/.installed $(EXTENSIONS)/.built
	$(BYTECODE)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --cov --cov-report=term $(PYTEST_ARGS)

# The API reference and the topic pages as a site in build/site (git-ignored): --strict fails
# on a broken link or anchor, a missing object or a docstring griffe cannot read.
docs: $(VENV)/.installed
	PYTHONPATH=src $(VENV)/bin/mkdocs build --strict --quiet

test: lint types unit docs

clean:
	rm -rf $(VENV) build src/*.egg-info .mypy_cache .ruff_cache .hypothesis
