# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install doccp, run `doccp demo`
#   make test   - create .venv, install doccp, run the whole test suite
# and: make docs (the documentation site, warnings are errors), make bench (the benchmarks).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench docs
$(VENV)/.ready: pyproject.toml scripts/setup-env.sh
	bash scripts/setup-env.sh $(VENV)

demo: $(VENV)/.ready
	$(VENV)/bin/doccp demo $(ARGS)

test: $(VENV)/.ready
	$(VENV)/bin/ruff check src tests bench examples docs/conf.py
	$(PY) -m pytest -q $(ARGS)

bench: $(VENV)/.ready
	$(VENV)/bin/doccp bench $(ARGS)

docs: $(VENV)/.ready
	$(VENV)/bin/sphinx-build -E -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"
