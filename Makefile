# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install doccp, run `doccp demo`
#   make test   - create .venv, install doccp, run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench
$(VENV)/.ready: pyproject.toml scripts/setup-env.sh
	bash scripts/setup-env.sh $(VENV)

demo: $(VENV)/.ready
	$(VENV)/bin/doccp demo $(ARGS)

test: $(VENV)/.ready
	$(VENV)/bin/ruff check src tests bench examples
	$(PY) -m pytest -q $(ARGS)

bench: $(VENV)/.ready
	$(VENV)/bin/doccp bench $(ARGS)
