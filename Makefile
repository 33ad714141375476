# The two commands a newcomer needs: `make run` and `make test` (`make test-fast` while working).
# Both create ./.venv on first use and install the project into it (nothing else is needed):
# `make run` the service and the client (clients/python: the `kp-scoring` command), `make test`
# the test tools as well.

VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test test-fast lint unit docs typescript openapi image-test bench promtool clean

CLIENT := clients/python
INSTALLED := pyproject.toml $(CLIENT)/pyproject.toml $(CLIENT)/VERSION

# pip, quiet but for real problems: setuptools' boxed notice that an editable install of `app`
# (a package at the checkout's root) reads the checkout is what this install is for.
PIP := $(BIN)/python -W 'ignore:Editable installation' -m pip install --quiet

# The service (package `app`) and the client (package `kp_scoring`), in one pip command: the
# client distribution is not on any registry, so the server does not name it as a dependency.
$(BIN)/.installed: $(INSTALLED)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(PIP) -e ./$(CLIENT) -e .
	touch $@

# ... and the documentation site's tools (mkdocs with the Material theme), for `make docs`.
$(BIN)/.installed-docs: $(BIN)/.installed
	$(PIP) -e '.[docs]'
	touch $@

# ... and the test tools (pytest, schemathesis, ruff, mypy, ...), the docs' among them.
$(BIN)/.installed-test: $(BIN)/.installed
	$(PIP) -e ./$(CLIENT) -e '.[test]'
	touch $@ $(BIN)/.installed-docs

## run: start the service on http://$(HOST):$(PORT) (settings from KP_* variables)
run: $(BIN)/.installed
	$(BIN)/python -m app.serve --host $(HOST) --port $(PORT)

## test: lint, type-check, build the docs and run the whole test suite (the TypeScript
## client's included)
test: lint docs typescript unit

## test-fast: the tests that need no live server, no redis-server, no promtool and no long run
test-fast: $(BIN)/.installed-test
	$(BIN)/python -m pytest -n auto --dist loadfile -m "not server and not redis and not slow and not promtool"

lint: $(BIN)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

unit: $(BIN)/.installed-test promtool
	$(BIN)/python -m pytest -n auto --dist loadfile

## docs: build the documentation site into site/ (mkdocs --strict: a broken link or a missing
## page fails); its pages open as files (site/index.html in a browser), and
## `.venv/bin/mkdocs serve` serves it while you edit
docs: $(BIN)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	@echo "the site is in site/: open site/index.html in a browser (the search box needs a server: .venv/bin/mkdocs serve)"

## typescript: install the TypeScript client's pinned dev packages (npm ci: node 20, npm) and
## build it; tests/test_typescript_client.py runs its tests against a live server
typescript:
	@node -e 'process.exit(+process.versions.node.split(".")[0] >= 20 ? 0 : 1)' 2>/dev/null || { \
		echo "the TypeScript client's tests need node 20+ and npm (Debian 12's nodejs is 18: use NodeSource's)"; \
		exit 1; }
	cd clients/typescript && npm ci --no-audit --no-fund && npm run build

## promtool: Debian's prometheus package, for tests/test_monitoring.py (promtool check and
## test the alert rules of deploy/prometheus/). Installed with apt-get when missing (needs root).
promtool:
	@command -v promtool >/dev/null || { \
		echo "installing Debian's prometheus package (the alert rules' tests need promtool)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@promtool --version | head -1

## openapi: regenerate openapi/ after an API change
openapi: $(BIN)/.installed
	$(BIN)/python -m app.openapi_export

## image-test: build the Docker image with podman and test it (installs podman; needs root)
image-test:
	bash scripts/image_test.sh

## bench: every phase of the benchmark (floor, load, window, shared, reference, memory);
## one phase: make bench PHASE=load (floor|load|cold|window|reference|memory|shared|precision|persistence)
PHASE ?= all
bench: $(BIN)/.installed-test
	$(BIN)/python -m bench $(PHASE) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build site *.egg-info
