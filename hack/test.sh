#!/usr/bin/env bash
# The test command (README, .ci/run): installs what it needs, then lint, type check,
# import contract, CRD drift check and the whole pytest suite: integration tests against a real
# kube-apiserver + etcd + kube-controller-manager built from the Go module proxy, and the end-to-end
# suite (tests/e2e) on a real single-node cluster (hack/cluster.sh) running the project's images.
#
#   bash hack/test.sh                 # everything
#   bash hack/test.sh tests/server    # extra args go to pytest
#   bash hack/test.sh --quick         # no root, Go or images: lint, types, contracts, CRD drift and the
#                                     # unit, server, trainer, local and stage tests without the control plane
# pytest runs in GRPO_TEST_WORKERS pytest-xdist workers (default 3: most tests wait on processes, sockets
# and the control plane, so three keep two cores busy); each worker has its own control plane and models,
# and tests/conftest.py keeps the end-to-end suite (the one real node) on one worker. 0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
step() { printf '\n== [%ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }   # seconds since the start: the cost of each step
QUICK=""
if [ "${1:-}" = --quick ]; then QUICK=1; shift; fi

step "python environment (.venv)"
bash hack/venv.sh
PY=.venv/bin/python

checks() {
  step "ruff"
  .venv/bin/ruff check .
  step "mypy"
  .venv/bin/mypy
  step "import contract (import-linter)"
  .venv/bin/lint-imports --no-cache
  step "CRD drift: crds/ must equal what the models generate"
  .venv/bin/grpo crd --check crds/grpo.dev_grporuns.yaml
}

pytest_run() {  # pytest_run ARGS...: exit code 5 (no tests collected) is a failure here
  step "pytest"
  set +e
  "$PY" -m pytest -n "${GRPO_TEST_WORKERS:-3}" --dist loadgroup "$@" -p no:cacheprovider --durations=30 --durations-min=15
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
  fi
  echo "total $(( $(date +%s) - t0 ))s"
  exit "$rc"
}

if [ -n "$QUICK" ]; then
  checks
  if [ $# -eq 0 ]; then set -- tests/unit tests/server tests/trainer tests/local tests/stage; fi
  pytest_run -m "not controlplane" "$@"
fi

step "Kubernetes test binaries (cached under ~/.cache/grpo-testbin)"
GRPO_TESTBIN_DIR=$(bash hack/build-testbin.sh)
export GRPO_TESTBIN_DIR
ls "$GRPO_TESTBIN_DIR"

step "real-node packages (Debian: runc, CNI plugins, iptables, buildah, mmdebstrap)"
bash hack/cluster.sh deps

step "images from the Dockerfiles (hack/images.sh, cached under ~/.cache/grpo-images)"
bash hack/images.sh build

step "GPU images (hack/images.sh gpu: ENGINE=vllm, built and smoke-tested on CPU, cached by their inputs)"
bash hack/images.sh gpu

checks
pytest_run "${@:-tests}"
