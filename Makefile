# worker-template: `make demo` bakes a service and runs it; `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test bench venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements-dev.txt infra/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

demo: venv
	$(BIN)/python scripts/demo.py

test: venv
	$(BIN)/python -m pytest -n 2

bench: venv
	for script in bench/*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) .demo build
