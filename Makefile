# Two commands for a new user: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The scheduler's query path under Python 3.10 with numpy alone (what a JetPack 6 board or a small service has)
PYTHON310 ?= $(shell for p in python3.10 $$HOME/.pyenv/versions/3.10*/bin/python3.10; do \
	$$p -c '' 2>/dev/null && { echo $$p; break; }; done)
VENV310 ?= .venv310
STAMP310 := $(VENV310)/.installed

.PHONY: demo test test-all test-slow test-py310 install clean lint docs

install: $(STAMP)

$(STAMP): setup.cfg setup.py pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[all,test,lint,docs]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/anytime demo --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest
	@if [ -n "$(PYTHON310)" ]; then $(MAKE) --no-print-directory test-py310; \
	else echo "skipped the Python 3.10 query-path tests: no python3.10 on this machine"; fi

$(STAMP310): constraints.txt
	@test -x $(VENV310)/bin/python || $(PYTHON310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install --quiet -c constraints.txt numpy pytest tomli
	@touch $(STAMP310)

# numpy, pytest and tomli only: any import of torch on the query path fails these tests
test-py310: $(STAMP310)
	PYTHONPATH=. $(VENV310)/bin/python -m pytest -p no:cacheprovider tests/test_query.py

# The slow studies and end-to-end runs left out of `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -m ""

# ruff (lint and format), mypy on the package, import-linter's layer contract (see setup.cfg)
lint: $(STAMP)
	$(BIN)/ruff check anytime tests benchmarks experiments models
	$(BIN)/ruff format --check anytime tests benchmarks experiments models
	$(BIN)/mypy anytime
	$(BIN)/lint-imports

# The documentation site (MkDocs), built strictly: a broken link or a stale page fails it
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(VENV310) build *.egg-info .pytest_cache site
