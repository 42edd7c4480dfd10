# `make train` and `make test` each set everything up from a fresh clone, then run.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup train test test-slow clean

setup:
	@bash tools/bootstrap.sh

train: setup
	$(BIN)/cxltrain train $(ARGS)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
