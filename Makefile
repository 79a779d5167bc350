# MILI set-up and checks. On a fresh machine, two commands do everything:
#   make serve   # install (first time only) and start MILI on the embedded demo model
#   make test    # install (first time only) and run every check CI runs
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUF := node_modules/.bin/buf
# torch first and pinned: 2.13.0 resolves to the local CPU build here; an unpinned torch would
# pull several GB of CUDA wheels.
TORCH_PIN := torch==2.13.0

.PHONY: setup serve test lint typecheck protos check-protos pytest kernels clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

node_modules/.installed: package.json package-lock.json
	# Exactly the lock file's packages (it lists buf's binary for every platform, as npm ci
	# needs): buf for the protos; grpc-js, proto-loader and protobufjs for the Node client test.
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

setup: $(VENV)/.installed node_modules/.installed

# Compile the Mojo attention kernels into the cache (seconds to a few minutes the first time for
# a given kernel source; a no-op afterwards). Services would build on first use anyway.
kernels: $(VENV)/.installed
	$(VENV)/bin/mili kernels build

serve: $(VENV)/.installed kernels
	$(VENV)/bin/mili serve

# Regenerate the Python stubs after editing protos/.
protos: $(VENV)/.installed
	$(PY) scripts/gen_protos.py

check-protos: setup
	PATH="$(CURDIR)/node_modules/.bin:$$PATH" scripts/check_protos.sh
	$(PY) scripts/gen_protos.py --check

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

pytest: $(VENV)/.installed node_modules/.installed kernels
	$(VENV)/bin/pytest -q

test: check-protos lint typecheck pytest

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache
