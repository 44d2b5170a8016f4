# netproxy — every target installs what it needs first (idempotent), then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BACKEND ?= auto

.PHONY: setup demo test test-unit test-kernel test-vm bench bench-smoke lint clean

setup: $(STAMP)
	@scripts/setup-system.sh

$(STAMP): pyproject.toml
	@scripts/setup-system.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	@touch $@

demo: setup
	$(PY) -m netproxy.lab.demo --backend $(BACKEND)

lint: setup
	$(VENV)/bin/ruff check netproxy backends tests bench vagrant
	$(VENV)/bin/mypy netproxy backends vagrant

test-unit: setup
	$(VENV)/bin/pytest -q tests/unit

test-kernel: setup
	$(VENV)/bin/pytest -q tests/kernel

bench-smoke: setup
	$(PY) -m bench --smoke

test-vm: setup
	vagrant/local/run-matrix

# The README's test command: lint, unit, kernel (network namespaces), the benchmark's smoke run,
# then the QEMU kernel matrix (three Debian kernels under software emulation).
test: setup
	$(VENV)/bin/ruff check netproxy backends tests bench vagrant
	$(VENV)/bin/mypy netproxy backends vagrant
	$(VENV)/bin/pytest -q tests
	$(PY) -m bench --smoke
	vagrant/local/run-matrix

bench: setup
	$(PY) -m bench
	$(PY) -m bench.storm

clean:
	rm -rf $(VENV) *.egg-info
