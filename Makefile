# Two commands for a new user: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all test-slow install clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,deploy]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/anytime demo --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest

# The slow studies and end-to-end runs left out of `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -m ""

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
