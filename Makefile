# netproxy — every target installs what it needs first (idempotent), then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BACKEND ?= auto

.PHONY: setup demo test test-all test-unit test-kernel test-vm bench bench-100k bench-smoke lint image clean control-plane mutation

setup: $(STAMP)
	@scripts/setup-system.sh
	@# promtool for deploy/monitoring/'s rule tests: from Debian's prometheus package, without installing it.
	@scripts/install-promtool $(VENV)/bin
	@# Go builds the real control plane the tests start (make control-plane): say now if it cannot.
	@scripts/build-control-plane --check || echo "setup: WARNING: make control-plane cannot build here; its tests will fail" >&2

$(STAMP): pyproject.toml lab/pyproject.toml
	@scripts/setup-system.sh
	@# A venv whose creation was interrupted has a python but no pip: make it again.
	@$(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV); $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	@# The lab is its own distribution (lab/README.md): the tests, the bench and the demo need it, the product does not.
	$(PY) -m pip install -q --no-deps -e lab
	@touch $@

demo: setup
	$(PY) -m netproxy_lab.demo --backend $(BACKEND)

lint: setup
	$(VENV)/bin/ruff check netproxy backends lab tests bench vagrant scripts/run-tests scripts/lint-structure \
		scripts/lint-types scripts/installed_layout.py scripts/types_probe.py scripts/mutation
	@# mypy over the layout the wheel installs (backends/ as netproxy.backends), with a probe: scripts/lint-types.
	$(PY) scripts/lint-types
	@# The lint scripts themselves; --scripts-are-modules, else mypy names both extension-less scripts __main__.
	$(VENV)/bin/mypy --scripts-are-modules scripts/lint-structure scripts/lint-types scripts/installed_layout.py \
		scripts/mutation
	@# The import layers (pyproject's [tool.importlinter]) and dead code (vulture): scripts/lint-structure.
	$(PY) scripts/lint-structure

# Mutation testing of the pure modules (scripts/mutation, docs/testing.md), not part of make test:
# each group's score and its survivors' diffs in build/mutation/report.txt. MUTATION_ARGS: groups,
# --sample N (a fixed sample per group), --jobs N (default 2).
mutation: $(VENV)/.mutation-installed
	$(PY) scripts/mutation $(MUTATION_ARGS)

$(VENV)/.mutation-installed: $(STAMP)
	$(PY) -m pip install -q -e '.[mutation]'
	@touch $@

test-unit: setup
	$(VENV)/bin/pytest -q -n 2 tests/unit tests/conformance

test-kernel: setup
	$(VENV)/bin/pytest -q -n 3 --dist worksteal tests/kernel

bench-smoke: setup
	$(PY) -m bench --smoke

test-vm: setup
	vagrant/local/run-matrix

# The README's test command (and CI's), the quick tier: setup, lint, unit, kernel and faults
# (network namespaces, in parallel), the serial group, the benchmark's smoke run, and the Debian 11
# legacy guest beside them. Timed stages, JUnit XML in results/ (docs/testing.md).
test:
	@$(PYTHON) scripts/run-tests quick

# The long tier: every backend/writer on every suite, the full fault suite with the soak sizes,
# the whole QEMU matrix. Run it before resolving a change to a backend.
test-all:
	@$(PYTHON) scripts/run-tests full

# kube-apiserver, kube-controller-manager and etcd at the release lab/controlplane/go.mod pins, built
# from Go modules into /var/cache/netproxy-controlplane (Go >= 1.26; a cold build is long, a warm one
# seconds: docs/testing.md); prints their paths and versions. Test infrastructure only.
control-plane:
	@scripts/build-control-plane

# The image the DaemonSets name, localhost/netproxy:<pyproject.toml's version>, built here without a
# container registry: a Debian base from mmdebstrap (cached in /var/cache/netproxy-image), the wheels
# built on the host, deploy/Containerfile; prints its size (scripts/build-image, deploy/README.md).
image: setup
	@scripts/setup-system.sh podman mmdebstrap runc
	@scripts/build-image

bench: setup
	$(PY) -m bench
	$(PY) -m bench.api
	$(PY) -m bench.relay
	$(PY) -m bench.storm

# 100,000 services × 10 endpoints on one node (issue 40): phase A at 100k on nftables and
# iptables-legacy/restore, then the API path at 100k (nftables; the real server left out: creating
# 200k objects through it takes longer than the run), then phase A at 44k on nftables (the largest
# public kube-proxy report; issue 40's 44k row). About 8-9 minutes on 2 CPUs (2026-12-07, docs/performance.md);
# bench/results/100k/, 44k/.
bench-100k: setup
	$(PY) -m bench --scale 100000
	$(PY) -m bench.api --services 100000 --backends nftables --burst 2000 --no-real --out bench/results/100k
	$(PY) -m bench --scale 44000 --backends nft

clean:
	rm -rf $(VENV) *.egg-info
