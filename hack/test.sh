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
# pytest: with no arguments, the end-to-end suite (tests/e2e: its session fixture brings up this machine's one
# real node) runs in a pytest process of its own, its output kept in a file and printed when it ends, while
# every other test runs beside it in GRPO_TEST_WORKERS pytest-xdist workers (default 2; most tests wait on
# processes, sockets and the control plane). Each worker has its own control plane, models and servers on
# free ports; --dist loadfile keeps a module's tests, and so its module-scoped servers, on one worker.
# With arguments, one pytest runs them in those workers (in one process when they name tests/e2e);
# GRPO_TEST_WORKERS=0 runs everything in one process, one suite after the other.
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
  # Its cache outlives the clean clone (~/.cache/grpo-mypy, one per mypy version): mypy checks each cached
  # module against its file's hash, its own version and the options, so the cache only skips unchanged work.
  MYPY_CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/grpo-mypy/$(.venv/bin/python -c 'import mypy.version as v; print(v.__version__)') \
    .venv/bin/mypy
  step "import contract (import-linter)"
  .venv/bin/lint-imports --no-cache
  step "CRD drift: crds/ must equal what the models generate"
  .venv/bin/grpo crd --check crds/grpo.dev_grporuns.yaml
  step "bytecode of the project's sources (compileall)"
  # Where PYTHONDONTWRITEBYTECODE is set (as in this machine's environment) no process writes a .pyc, so each
  # of the suite's Python processes would compile the project's modules again (0.1 s of CPU for one that
  # imports every package, measured); compiled once here, they are read. __pycache__ is ignored by git, by
  # the images' build context and by their input hash.
  .venv/bin/python -m compileall -q -j 0 services operator tests > /dev/null
}

WORKERS=${GRPO_TEST_WORKERS:-2}

run_pytest() {  # run_pytest ARGS...: one pytest; its exit code 5 (no tests collected) is a failure here
  local rc=0
  "$PY" -m pytest "$@" -p no:cacheprovider --durations=30 --durations-min=15 || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest $* collected no tests: that is a failure here" >&2
    rc=1
  fi
  return "$rc"
}

pytest_run() {  # pytest_run ARGS...: the given tests, in WORKERS workers unless they name the end-to-end suite
  local workers=$WORKERS rc=0
  for arg in "$@"; do
    case $arg in tests/e2e*) workers=0 ;; esac
  done
  step "pytest ($workers workers): $*"
  run_pytest -n "$workers" --dist loadfile "$@" || rc=$?
  echo "total $(( $(date +%s) - t0 ))s"
  exit "$rc"
}

pytest_all() {  # the end-to-end suite in its own process, beside every other test in WORKERS workers
  if [ "$WORKERS" -eq 0 ]; then
    pytest_run tests
  fi
  local e2e_log rest_rc=0 e2e_rc=0
  e2e_log=$(mktemp /tmp/grpo-e2e-XXXXXX.log)
  step "pytest: tests/e2e in one process (output in $e2e_log, printed when it ends), beside the other tests in $WORKERS workers"
  run_pytest -n 0 tests/e2e > "$e2e_log" 2>&1 &
  local e2e_pid=$!
  trap 'kill "$e2e_pid" 2>/dev/null || true' EXIT   # a failed or interrupted run leaves no suite behind
  run_pytest -n "$WORKERS" --dist loadfile tests --ignore=tests/e2e || rest_rc=$?
  step "the other tests ended (exit $rest_rc); waiting for tests/e2e"
  wait "$e2e_pid" || e2e_rc=$?
  step "pytest tests/e2e (exit $e2e_rc)"
  cat "$e2e_log"
  echo "tests/e2e exit $e2e_rc, the other tests exit $rest_rc; total $(( $(date +%s) - t0 ))s"
  if [ "$rest_rc" -ne 0 ]; then exit "$rest_rc"; fi
  exit "$e2e_rc"
}

if [ -n "$QUICK" ]; then
  checks
  if [ $# -eq 0 ]; then set -- tests/unit tests/server tests/trainer tests/local tests/stage; fi
  pytest_run -m "not controlplane" "$@"
fi

step "real-node packages (Debian: runc, CNI plugins, iptables, buildah, mmdebstrap)"
bash hack/cluster.sh deps

# The images (mostly downloads, unpacking and layer I/O) build beside the Go builds of the test binaries and the
# checks (mostly CPU): on a cold machine the two were 12 and 20 minutes one after the other. The pause image's
# binary comes from build-testbin.sh, whose per-tool lock makes the two callers wait for each other, not build twice.
images_log=$(mktemp /tmp/grpo-images-XXXXXX.log)
step "images from the Dockerfiles, then the GPU images (hack/images.sh build, gpu; cached under ~/.cache/grpo-images), in the background (output in $images_log, printed when they end)"
( bash hack/images.sh build && bash hack/images.sh gpu ) > "$images_log" 2>&1 &
images_pid=$!
trap 'pkill -P "$images_pid" 2>/dev/null; kill "$images_pid" 2>/dev/null || true' EXIT   # a failed step leaves no build behind

step "Kubernetes test binaries (cached under ~/.cache/grpo-testbin)"
GRPO_TESTBIN_DIR=$(bash hack/build-testbin.sh)
export GRPO_TESTBIN_DIR
ls "$GRPO_TESTBIN_DIR"

checks

step "waiting for the images"
images_rc=0
wait "$images_pid" || images_rc=$?
trap - EXIT
cat "$images_log"
step "images built (exit $images_rc)"
if [ "$images_rc" -ne 0 ]; then exit "$images_rc"; fi
if [ $# -gt 0 ]; then pytest_run "$@"; fi
pytest_all
