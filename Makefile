# worker-template: `make demo` bakes a service and runs it; `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo wheelhouse locks test lint e2e-build e2e bench bench-report venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements-dev.txt runtime/pyproject.toml infra/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

demo: venv
	$(BIN)/python scripts/demo.py

# build/wheelhouse: what a bake of this checkout installs (its dependencies, dev tools, the
# Pulumi program's requirements, setuptools), for this Python: with it, a bake's make install
# and make infra-install run with no network (scripts/wheelhouse.py). Needs the index once.
wheelhouse: venv
	$(BIN)/python scripts/wheelhouse.py

# {{cookiecutter.project}}/locks: the lock files every bake carries (per Python and options,
# the versions of requirements-dev.txt; the post-gen hook keeps the bake's pair). After a
# change of a dependency or a pin; tests/test_packaging.py runs `scripts/locks.py --check`.
locks: venv
	$(BIN)/python scripts/locks.py

# The e2e tests (marker e2e) run alone in `make e2e`: a real control plane wants the cores.
test: venv
	$(BIN)/python -m pytest -n 2 -m "not e2e"

# The real engines of `make e2e` (kube-apiserver & co, kwok, the Pulumi CLI and its
# Kubernetes provider, the kubelet, KEDA's operator and metrics adapter), built once per
# machine into $(E2E_CACHE) (default ~/.cache/worker-template-e2e), keyed by their versions
# (scripts/e2e/build.py); then the real node's local base image (debootstrap + buildah,
# keyed by its recipe: scripts/e2e/images.py; skipped without them on a desk).
e2e-build:
	$(PYTHON) scripts/e2e/build.py
	$(PYTHON) scripts/e2e/images.py --base-only

# `pulumi up` for real (#33, #43), in CI (.ci/run). tests/test_e2e_cluster.py: a real control
# plane with a kwok node (scripts/e2e/cluster.py: etcd, kube-apiserver, controller-manager,
# scheduler, kwok): the harness stops what it started, then a fresh bake's dev stack through
# the real Pulumi engine (scripts/e2e/run.py: up, one pool's roll, a replacement, wrong stacks
# refused by the real admission, destroy). tests/test_e2e_node.py: a real node (containerd,
# runc, the bridge CNI and the kubelet in namespaces of their own: scripts/e2e/node.py) that
# leaves the host as it was, after a SIGKILL too. tests/test_e2e_pods.py: the bake's own image
# on real pods through the real Pulumi engine (scripts/e2e/pods.py: up, autoscaling by the
# real KEDA on a real backlog scraped by Debian's Prometheus, a roll with a ledger, a wedged
# handler, a handler past its memory limit, destroy). The engines are built first when they
# are not cached (e2e-build: under a second when they are).
e2e: venv e2e-build
	$(BIN)/python -m pytest tests/test_e2e_cluster.py tests/test_e2e_node.py tests/test_e2e_pods.py -m e2e -p no:xdist -p no:cacheprovider -s -v

# ruff on worker_runtime (runtime/pyproject.toml), worker_infra (infra/pyproject.toml) and
# the benchmarks (bench/ruff.toml); mypy --strict on worker_runtime and its tests, and on
# worker_infra; the import
# contracts of both libraries: tests/test_lint.py runs the same. Each bake's own `make lint`
# (its contracts in its pyproject.toml) runs in tests/test_template.py.
lint: venv
	$(BIN)/python -m ruff check runtime infra/worker_infra bench
	$(BIN)/python -m ruff format --check runtime infra/worker_infra bench
	cd runtime && $(abspath $(BIN))/python tests/templateservice.py && $(abspath $(BIN))/python -m mypy
	cd infra && $(abspath $(BIN))/python -m mypy
	cd runtime && $(abspath $(BIN))/lint-imports --no-cache
	cd infra && $(abspath $(BIN))/lint-imports --no-cache

# Each benchmark writes bench/results/<script>-<UTC>.json; the report prints one table
# from the latest of each (bench-report alone reprints it).
BENCHES := throughput_bench compare_bench call_count lifecycle_bench metrics_bench sandbox_overhead bake_bench \
           capacity_bench idle_cost console_bench flow_bench unique_bench

bench: venv
	for script in $(BENCHES); do \
	  if [ -f bench/$$script.py ]; then $(BIN)/python bench/$$script.py || exit 1; fi; done
	$(BIN)/python bench/report.py

bench-report: venv
	$(BIN)/python bench/report.py

clean:
	rm -rf $(VENV) .demo build
